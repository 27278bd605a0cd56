"""For every test: servers it starts keep their state (stored Responses) in the test's own
folder, never in the user's state directory; SDK clients it made with
:func:`serving.closing` are closed when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import close_clients


@pytest.fixture(autouse=True)
def private_state(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("ORTSERVE_STATE_DIR", str(state))
    return state


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    close_clients()
