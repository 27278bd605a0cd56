"""The draft folder's proposer for the ort-cpu engine's speculative decoding
(``speculative="draft:FOLDER"``), and how many drafts a check is worth."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .._config import ModelConfig
from .._contract import Request
from .._errors import ModelLoadError
from .._folder import GenaiFolder
from ._decoder_graph import LAST_POSITION, LOGIT_POSITIONS, DecoderGraph
from ._host_memory import unhuged_zeros

__all__ = ["DraftModel", "draft_length", "weight_bytes"]


class DraftModel:
    """A smaller model with the same tokenizer that drafts greedily for the request being
    checked (``speculative="draft:FOLDER"``; speculation runs for a request alone, so one
    cache row follows one request at a time: switching requests prefills the new one's
    sequence, and a rejected draft is dropped by keeping the row's common prefix with the
    sequence). Greedy drafts put all their weight on one guess, so checking them as
    :meth:`~._ort_cpu.OrtCpuEngine._speculate` does keeps a sampled request's distribution."""

    def __init__(self, target: GenaiFolder, config: ModelConfig, max_sequence_length: int) -> None:
        path = config.draft_folder
        assert path is not None
        try:
            folder = GenaiFolder.read(path)
            same = folder.tokenizer_path.read_bytes() == target.tokenizer_path.read_bytes()
        except (ModelLoadError, OSError) as exc:
            raise ModelLoadError(f"speculative draft model {path}: {exc}", path=path) from exc
        if not same or folder.model.get("vocab_size") != target.model.get("vocab_size"):
            raise ModelLoadError(
                f"speculative draft model {path} has another tokenizer than {target.path} (tokenizer.json and "
                "vocab_size must match): its tokens would be another model's",
                path=path,
            )
        self.graph = DecoderGraph(folder.path, folder.genai, dataclasses.replace(config, speculative=None))
        shapes = [(1, heads, max_sequence_length, size) for heads, size in self.graph.layer_shapes]
        dtype = self.graph.cache_dtype
        self._cache = [(unhuged_zeros(shape, dtype), unhuged_zeros(shape, dtype)) for shape in shapes]
        self._binding = self.graph.session.io_binding()
        self.graph.bind_cache(self._binding, self._cache, slice(0, 1))
        self._chunk = config.prefill_chunk_tokens
        self.cost = weight_bytes(folder.path) / max(weight_bytes(target.path), 1)
        """A draft token's cost in the target's decode steps, by their weights' sizes."""
        self._owner: Request | None = None
        self._cached: list[int] = []
        """The tokens whose key/values the row holds."""

    def propose(self, request: Request, size: int) -> list[int]:
        """``size`` greedy tokens to follow ``request``'s sequence."""
        sequence = [*request.prompt, *request.tokens]
        if self._owner is not request:
            self._owner, self._cached = request, []
        common = 0
        for cached, token in zip(self._cached, sequence, strict=False):
            if cached != token:
                break
            common += 1
        common = min(common, len(sequence) - 1)  # the last token goes in: its logits draft
        for start in range(common, len(sequence), self._chunk):
            logits = self._run(sequence[start : start + self._chunk], start)
        drafts = [int(np.argmax(logits))]
        while len(drafts) < size:
            drafts.append(int(np.argmax(self._run(drafts[-1:], len(sequence) + len(drafts) - 1))))
        self._cached = sequence + drafts[:-1]
        return drafts

    def _run(self, ids: list[int], start: int) -> npt.NDArray[np.float32]:
        graph, binding = self.graph, self._binding
        end = start + len(ids)
        binding.bind_cpu_input(graph.input_ids, np.asarray([ids], dtype=graph.ids_dtype))
        binding.bind_cpu_input(graph.attention_mask, np.ones((1, end), dtype=graph.mask_dtype))
        if graph.has_position_ids:
            binding.bind_cpu_input(graph.position_ids, np.arange(start, end, dtype=graph.ids_dtype)[None, :])
        if graph.last_only:
            binding.bind_cpu_input(LOGIT_POSITIONS, LAST_POSITION)
        binding.bind_output(graph.logits)
        graph.session.run_with_iobinding(binding)
        logits: npt.NDArray[np.float32] = binding.get_outputs()[-1].numpy()[0, -1]
        return logits


def weight_bytes(folder: Path) -> int:
    """The size of a model folder's ONNX files and their external data."""
    return sum(path.stat().st_size for path in folder.iterdir() if ".onnx" in path.name)


def draft_length(acceptance: float, available: int, draft_cost: float = 0.0) -> int:
    """The draft length (up to ``available``; 0: none) that yields the most tokens a second
    if each draft token is accepted with chance ``acceptance`` given the ones before it
    were: a call checking ``k`` drafts yields ``1 + a + ... + a**k`` tokens and costs
    ``1.1 + 0.2 (k - 1)`` decode steps (measured at 300 tokens of context: SmolLM2-135M
    int4 2.0x for 4 drafts and 2.75x for 8; the 0.5B-shaped model 1.10x, 1.66x and 2.6x
    for 1, 4 and 8).

    A draft model adds ``draft_cost`` decode steps per draft token. A fixed model, not
    timings: a request's drafts, and so the calls its tokens are computed in, then depend on
    the request alone (see :meth:`~._ort_cpu.OrtCpuEngine._speculate`).
    """
    best, best_rate = 0, 1.0
    expected = 1.0
    for size in range(1, available + 1):
        expected += acceptance**size
        rate = expected / (1.1 + 0.2 * (size - 1) + draft_cost * size)
        if rate > best_rate:
            best, best_rate = size, rate
    return best
