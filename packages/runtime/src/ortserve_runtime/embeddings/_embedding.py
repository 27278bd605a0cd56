"""Embedding models: an ONNX encoder plus ``tokenizer.json``, with the micro-batcher of
:mod:`._encoder` and pooling (mean, CLS, last token) plus L2 normalisation.

Inputs are checked one by one, so an input that is too long fails only its own request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._config import ModelConfig
from .._errors import ContextLengthError, InvalidRequestError, ModelLoadError
from ._encoder import ENCODE_BATCH, BatchedEncoder, Tokens, read_json

__all__ = ["EmbeddingInput", "EmbeddingModel", "EmbeddingResult", "Pooling"]


Pooling = Literal["mean", "cls", "last"]
EmbeddingInput = str | Sequence[str | int | Sequence[int]]
"""One text, texts, one list of token ids, or lists of token ids (not mixed)."""


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """One request's vectors (rows in input order) and token counts."""

    vectors: npt.NDArray[np.float32]
    token_counts: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


class EmbeddingModel(BatchedEncoder):
    """A sentence embedding model served with micro-batching (see the module docstring)."""

    kind: Literal["embedding"] = "embedding"
    kind_label = "embedding"

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        settings = config.embeddings
        super().__init__(
            name,
            folder,
            config,
            max_batch_size=settings.max_batch_size,
            run_tokens=settings.run_tokens,
            max_wait_ms=settings.max_wait_ms,
        )
        self.normalize = settings.normalize
        self.truncate = settings.truncate
        self.max_inputs = settings.max_inputs
        self.max_request_tokens = settings.max_request_tokens
        self.pooling: Pooling = settings.pooling or _pooling_mode(folder)
        outputs = self.session.get_outputs()
        pooled = [o for o in outputs if len(o.shape) == 2]
        hidden = [o for o in outputs if len(o.shape) == 3]
        if hidden:
            self._output, self._pre_pooled = hidden[0].name, False
            dims = hidden[0].shape
        elif pooled:
            self._output, self._pre_pooled = pooled[0].name, True
            dims = pooled[0].shape
        else:
            raise ModelLoadError(f"{self.model_path} has no hidden-state or embedding output", path=self.model_path)
        self.dimension = dims[-1] if isinstance(dims[-1], int) else self._probe_dimension()
        self._start()

    # -- public API ------------------------------------------------------------------------

    def tokenize(self, inputs: EmbeddingInput, *, truncate: bool | None = None) -> list[list[int]]:
        """Token ids for each input, checked against the model's limit and vocabulary."""
        items = _as_list(inputs)
        if not items:
            raise InvalidRequestError("input must not be empty", param="input")
        if len(items) > self.max_inputs:
            raise InvalidRequestError(
                f"input has {len(items)} items; this server embeds at most {self.max_inputs} per request",
                param="input",
            )
        cut = self.truncate if truncate is None else truncate
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        texts = [(i, x) for i, x in enumerate(items) if isinstance(x, str)]
        for number, (index, text) in enumerate(texts):
            if not text:
                raise InvalidRequestError(f"input[{index}] is an empty string", param="input")
            if len(text) > self.max_input_chars:
                if not cut:
                    raise ContextLengthError(
                        f"input[{index}] has {len(text)} characters, more than this model's {self.max_tokens} "
                        "tokens could hold; shorten it or ask for truncation",
                        param="input",
                    )
                texts[number] = (index, text[: self.max_input_chars])  # still past the limit: cut below
        # A few texts at a time, each cut (or refused) as soon as it is tokenized: the
        # tokenizer's encodings of 2,048 texts of 8,000 characters took 510 MiB at once, and
        # a text too long was refused only once all of them were tokenized (24 s).
        encoded: dict[int, list[int]] = {}
        total = sum(min(len(x), self.max_tokens) if cut else len(x) for x in items if not isinstance(x, str))
        self._check_total(total)
        for start in range(0, len(texts), ENCODE_BATCH):
            batch = texts[start : start + ENCODE_BATCH]
            for (index, _), encoding in zip(batch, self.tokenizer.encode_batch([t for _, t in batch]), strict=True):
                encoded[index] = self._fit(index, list(encoding.ids), cut, text=True)
                total += len(encoded[index])
            self._check_total(total)
        result: list[list[int]] = []
        for index, item in enumerate(items):
            if isinstance(item, str):
                ids = encoded[index]
            else:
                ids = [int(t) for t in item]
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise InvalidRequestError(
                        f"input[{index}] has token id {bad[0]} outside the vocabulary", param="input"
                    )
                ids = self._fit(index, ids, cut, text=False)
            if not ids:
                raise InvalidRequestError(f"input[{index}] has no tokens", param="input")
            result.append(ids)
        return result

    def _check_total(self, tokens: int) -> None:
        """Refuse a request whose inputs have more than ``max_request_tokens`` tokens in all
        (token-id inputs counted as given, texts as tokenized so far)."""
        if tokens > self.max_request_tokens:
            raise InvalidRequestError(
                f"input has more than {self.max_request_tokens} tokens in all; this server embeds at most "
                f"{self.max_request_tokens} per request (split it into several)",
                param="input",
            )

    def _fit(self, index: int, ids: list[int], cut: bool, *, text: bool) -> list[int]:
        """``ids`` within the model's limit: cut (a text keeps its closing special token) or,
        without ``cut``, refused."""
        if len(ids) <= self.max_tokens:
            return ids
        if not cut:
            raise ContextLengthError(
                f"input[{index}] has {len(ids)} tokens, more than this model's {self.max_tokens}; "
                "shorten it or ask for truncation",
                param="input",
            )
        return ids[: self.max_tokens - 1] + ids[-1:] if text else ids[: self.max_tokens]

    async def embed(
        self,
        inputs: EmbeddingInput,
        *,
        truncate: bool | None = None,
        dimensions: int | None = None,
    ) -> EmbeddingResult:
        """Embed text or token-id inputs; concurrent calls share session runs."""
        self._check_dimensions(dimensions)
        # Off the event loop: 50,000 inputs took the loop 2 s to tokenize.
        ids = await asyncio.to_thread(self.tokenize, inputs, truncate=truncate)
        vectors = await self._submit([Tokens(x) for x in ids])
        return EmbeddingResult(self._finish(vectors, dimensions), [len(x) for x in ids])

    def embed_sync(
        self,
        inputs: EmbeddingInput,
        *,
        truncate: bool | None = None,
        dimensions: int | None = None,
    ) -> EmbeddingResult:
        """The same, for synchronous callers: one session run per batch, no merging."""
        self._check_dimensions(dimensions)
        ids = self.tokenize(inputs, truncate=truncate)
        rows = self._run_batches([Tokens(x) for x in ids])
        return EmbeddingResult(self._finish(np.stack(rows), dimensions), [len(x) for x in ids])

    def _reduce(self, hidden: npt.NDArray[np.float32], mask: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """Pooled vectors of a batch (a model with a pooled output is taken as it is)."""
        if self._pre_pooled:
            return hidden
        if self.pooling == "cls":
            return np.asarray(hidden[:, 0], dtype=np.float32)
        if self.pooling == "last":
            lengths = mask.sum(axis=1) - 1
            return np.asarray(hidden[np.arange(len(hidden)), lengths], dtype=np.float32)
        weights = mask[:, :, None].astype(np.float32)
        return np.asarray((hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9), dtype=np.float32)

    # -- helpers ---------------------------------------------------------------------------

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is not None and not 1 <= dimensions <= self.dimension:
            raise InvalidRequestError(
                f"dimensions must be between 1 and this model's {self.dimension}", param="dimensions"
            )

    def _finish(self, vectors: npt.NDArray[np.float32], dimensions: int | None) -> npt.NDArray[np.float32]:
        """Truncate (Matryoshka) then normalise, as OpenAI's ``dimensions`` does."""
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
        if self.normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def _probe_dimension(self) -> int:
        return int(self._forward([Tokens([self._pad_id])]).shape[-1])


def _as_list(inputs: EmbeddingInput) -> list[str | Sequence[int]]:
    """One text, texts, one list of token ids, or lists of token ids -> a list of inputs."""
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    if items and all(isinstance(x, int) for x in items):
        return [items]  # type: ignore[list-item]
    texts = all(isinstance(x, str) for x in items)
    token_lists = all(isinstance(x, list | tuple) and all(isinstance(t, int) for t in x) for x in items)
    if not (texts or token_lists):
        raise InvalidRequestError(
            "input must be a string, strings, token ids or lists of token ids, not a mix", param="input"
        )
    return items  # type: ignore[return-value]


def _pooling_mode(folder: Path) -> Pooling:
    """From sentence-transformers' 1_Pooling/config.json; mean when absent."""
    config_path = folder / "1_Pooling" / "config.json"
    if config_path.exists():
        config = read_json(config_path)
        if config.get("pooling_mode_cls_token"):
            return "cls"
        if config.get("pooling_mode_lasttoken"):
            return "last"
    return "mean"
