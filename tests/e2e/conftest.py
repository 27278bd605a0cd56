"""Fixtures for the end-to-end tests: the asyncio backend, and a sidecar lock folder per test."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def private_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sidecar port locks in the test's own folder, so tests never see each other's (or a user's)."""
    monkeypatch.setattr("ortserve_client._sidecar.LOCK_DIR", tmp_path / "locks")
