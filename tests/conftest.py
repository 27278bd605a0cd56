"""For every test: servers it starts keep their state (stored Responses) in the test's own
folder, never in the user's state directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def private_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("ORTSERVE_STATE_DIR", str(state))
    return state
