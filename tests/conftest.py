"""For every test: servers it starts keep their state (stored Responses) in the test's own
folder, never in the user's state directory.

The longest modules are collected first: ``pytest -n 2 --dist loadfile`` hands modules to
the workers in collection order, so a long module collected last (Ray Serve's, 2-3 min)
kept one worker busy while the other had nothing left to do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

LONGEST_FIRST = (
    "tests/server/test_ray.py",
    "tests/e2e/test_cli.py",
    "tests/server/test_fuzz.py",
    "tests/e2e/test_examples.py",
    "tests/e2e/test_sidecar.py",
    "tests/e2e/test_batches.py",
    "tests/e2e/test_durable_state.py",
    "tests/e2e/test_shared_state.py",
    "tests/runtime/test_voice.py",
    "tests/runtime/test_speculative.py",
)
"""Modules by their time in CI (``--durations``), the longest first."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def private_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("ORTSERVE_STATE_DIR", str(state))
    return state
