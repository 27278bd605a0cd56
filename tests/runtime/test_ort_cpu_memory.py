"""The ort-cpu engine's memory: cache rows given back when requests finish, weights mapped
from the folder (linked files too), and one IO binding per row range reused."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from og_reference import og_greedy
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry
from ortserve_runtime.engines import _ort_cpu
from serving import TINY_MODEL

pytestmark = pytest.mark.anyio

GREEDY = GenerationOptions(max_tokens=24, min_tokens=24, temperature=0)


def resident_bytes(arrays: list[np.ndarray]) -> int:
    """Bytes of ``arrays`` that are resident now (from /proc/self/smaps; Linux)."""
    spans = [(a.__array_interface__["data"][0], a.__array_interface__["data"][0] + a.nbytes) for a in arrays]
    total, overlap = 0, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if match := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            start, end = int(match[1], 16), int(match[2], 16)
            overlap = sum(max(0, min(end, b) - max(start, a)) for a, b in spans)
            size = end - start
        elif line.startswith("Rss:") and overlap:
            # A mapping shared with other data counts in proportion (the arrays' own maps are whole).
            total += int(line.split()[1]) * 1024 * overlap // size
            overlap = 0
    return total


async def burst(model: ChatModel, count: int) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        prompt = [(7 * i + j) % 900 + 20 for j in range(150)]
        return [e.token_id async for e in model.generate(prompt, options=GREEDY) if e.token_id is not None]

    return await asyncio.gather(*(one(i) for i in range(count)))


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")
@pytest.mark.parametrize("give_back", [True, False])
async def test_finished_requests_give_their_cache_rows_back(give_back: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not give_back:  # the control: the same burst without it leaves its rows resident
        monkeypatch.setattr(_ort_cpu, "give_back", lambda array, start, end: None)
    registry = ModelRegistry(ModelConfig(prefix_cache_tokens=0))
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    try:
        arrays = [array for pair in model.engine._cache for array in pair]  # type: ignore[attr-defined]
        assert resident_bytes(arrays) == 0  # nothing is taken before a row is written
        await burst(model, 6)
        left = resident_bytes(arrays)
        if give_back:
            assert left == 0
        else:
            assert left >= 6 * 150 * 16  # at least the prompts' keys and values, one layer's worth
    finally:
        await registry.close()


async def test_weights_in_linked_files_load_and_generate_alike(tmp_path: Path) -> None:
    """The Hugging Face cache links a folder's files to blobs elsewhere: onnxruntime refuses
    external data outside the model's folder, so the engine maps it from where it lies."""
    linked = tmp_path / "linked"
    blobs = tmp_path / "blobs"
    linked.mkdir()
    blobs.mkdir()
    for file in TINY_MODEL.iterdir():
        blob = blobs / f"sha-{file.name}"
        blob.write_bytes(file.read_bytes())
        (linked / file.name).symlink_to(blob)
    registry = ModelRegistry()
    registry.add("linked", linked)
    model: ChatModel = await registry.get("linked")
    try:
        prompt = model.encode("The quick brown fox")
        tokens = [e.token_id async for e in model.generate(prompt, options=GREEDY) if e.token_id is not None]
        assert tokens == og_greedy(prompt, 24)
    finally:
        await registry.close()


async def test_a_decode_step_reuses_the_binding_of_its_rows() -> None:
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    try:
        engine = model.engine
        made: list[object] = []
        new_binding = engine._new_binding  # type: ignore[attr-defined]

        def counting(*args: object) -> object:
            made.append(args)
            return new_binding(*args)

        engine._new_binding = counting  # type: ignore[attr-defined]
        results = await burst(model, 3)
        assert all(len(tokens) == 24 for tokens in results)
        # 3 prefills and decode steps over 3, 2 and 1 rows at most (rows only shrink here),
        # against one binding per decoder run before.
        assert engine.steps >= 24 and len(made) <= 6  # type: ignore[attr-defined]
    finally:
        await registry.close()
