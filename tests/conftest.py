"""For every test: servers it starts keep their state (stored Responses) in the test's own
folder, never in the user's state directory; SDK clients it made with
:func:`serving.closing` are closed when it ends. The longest files run first; ``-m timing``
imports only the files that mark tests so."""

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


_LONGEST_FILES = (
    "server/test_ray.py",
    "server/test_gguf_api.py",
    "e2e/test_sidecar.py",
    "runtime/test_speculative.py",
    "runtime/test_engines.py",
    "e2e/test_examples.py",
    "runtime/test_engine_choice.py",
    "e2e/test_shared_state.py",
    "server/test_model_ops.py",
)
"""The files that take longest (``--durations``, 2026-11-28: test_ray.py alone some two
minutes). The README's command hands whole files to two workers in collection order
(``--dist loadfile``); these last, one worker ran on alone while the other had finished."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
    here = Path(__file__).parent

    def order(item: pytest.Item) -> int:
        try:
            return rank.get(item.path.relative_to(here).as_posix(), len(rank))
        except ValueError:  # a test outside tests/
            return len(rank)

    items.sort(key=order)  # stable: each file's tests stay together and in order


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m timing`` (the README's second run), a test file that never names the
    marker has no test to run: importing it only to deselect every test took 10 s of the
    run's 24 s collection (SDKs, Ray, the fuzzing plugins). The marker is set in the files
    themselves (``pytestmark`` or a decorator), never by a conftest hook."""
    if config.option.markexpr != "timing" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    return "mark.timing" not in collection_path.read_text(encoding="utf-8")
