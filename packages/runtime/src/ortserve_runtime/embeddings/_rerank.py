"""Rerank (cross-encoder) models: a ``*ForSequenceClassification`` ONNX export with one
label plus ``tokenizer.json``, run by the micro-batcher of :mod:`._encoder`.

A (query, document) pair is encoded by the tokenizer's own pair template (its
post-processor: ``[CLS] query [SEP] document [SEP]`` with token types 0 then 1 for BERT),
exactly as transformers' ``tokenizer(query, document)`` does. The score is the model's one
logit through the activation sentence-transformers' ``CrossEncoder`` applies, which is
also what vLLM returns: sigmoid (a score in 0..1) unless the folder's config.json names
``Identity`` (then the raw logit). llama-server returns raw logits; set
``RerankConfig.activation="none"`` to match it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from .._config import ModelConfig
from .._errors import ContextLengthError, InvalidRequestError, ModelLoadError
from ._encoder import ENCODE_BATCH, BatchedEncoder, Tokens, read_json

__all__ = ["RerankModel", "RerankResult"]

_ACTIVATION_KEYS = ("activation_fn", "sbert_ce_default_activation_function")
"""Where sentence-transformers records a CrossEncoder's activation in config.json (v4+
under ``sentence_transformers``, earlier at the top level)."""


@dataclass(frozen=True, slots=True)
class RerankResult:
    """One request's scores (one per pair, in input order) and token counts per pair."""

    scores: npt.NDArray[np.float32]
    token_counts: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


class RerankModel(BatchedEncoder):
    """A cross-encoder that scores (query, document) pairs (see the module docstring)."""

    kind: Literal["rerank"] = "rerank"
    kind_label = "rerank"

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        settings = config.rerank
        super().__init__(
            name,
            folder,
            config,
            max_batch_size=settings.max_batch_size,
            run_tokens=settings.run_tokens,
            max_wait_ms=settings.max_wait_ms,
        )
        self.truncate = settings.truncate
        self.max_documents = settings.max_documents
        outputs = self.session.get_outputs()
        logits = [o for o in outputs if o.name == "logits"] or [o for o in outputs if len(o.shape) == 2]
        if not logits or len(logits[0].shape) != 2:
            raise ModelLoadError(
                f"{self.model_path} has no logits output of shape (batch, labels); not a sequence classifier",
                path=self.model_path,
            )
        self._output = logits[0].name
        labels = logits[0].shape[1]
        if not isinstance(labels, int):
            labels = _num_labels(folder)
        if labels != 1:
            raise ModelLoadError(
                f"{self.model_path} has {labels} labels; a reranker needs one relevance logit (num_labels 1)",
                path=self.model_path,
            )
        self.activation: Literal["sigmoid", "none"] = settings.activation or _activation(folder)
        # A second tokenizer that truncates, so that a request asking for truncation cuts
        # its pairs the way transformers' truncation=True does (longest first), with room
        # for the template's special tokens.
        self._truncating = Tokenizer.from_str(self.tokenizer.to_str())
        self._truncating.enable_truncation(self.max_tokens, strategy="longest_first")
        self._start()

    def tokenize_pairs(
        self,
        queries: str | Sequence[str],
        documents: Sequence[str],
        *,
        truncate: bool | None = None,
        names: tuple[str, str] = ("query", "documents"),
    ) -> list[Tokens]:
        """The pairs (one query with every document, or ``queries[i]`` with ``documents[i]``)
        encoded and checked against the model's limit; errors name the fields ``names``."""
        first, second = names
        if not documents:
            raise InvalidRequestError(f"{second} must not be empty", param=second)
        if len(documents) > self.max_documents:
            raise InvalidRequestError(
                f"{second} has {len(documents)} items; this server scores at most {self.max_documents} per request",
                param=second,
            )
        if isinstance(queries, str):
            pairs = [(queries, document) for document in documents]
            where_query = [first] * len(documents)
        else:
            if len(queries) != len(documents):
                raise InvalidRequestError(
                    f"{first} has {len(queries)} items and {second} {len(documents)}; give one {first} "
                    f"or as many as {second}",
                    param=first,
                )
            pairs = list(zip(queries, documents, strict=True))
            where_query = [f"{first}[{i}]" for i in range(len(queries))]
        cut = self.truncate if truncate is None else truncate
        for index, (query, document) in enumerate(pairs):
            for where, text, param in ((where_query[index], query, first), (f"{second}[{index}]", document, second)):
                if not text:
                    raise InvalidRequestError(f"{where} is an empty string", param=param)
            if len(query) + len(document) > self.max_input_chars:
                if not cut:
                    raise ContextLengthError(
                        f"{second}[{index}] with its query has {len(query) + len(document)} characters, more than "
                        f"this model's {self.max_tokens} tokens could hold; shorten it or ask for truncation",
                        param=second,
                    )
                pairs[index] = (query[: self.max_input_chars], document[: self.max_input_chars])
        tokenizer = self._truncating if cut else self.tokenizer
        result = []
        for start in range(0, len(pairs), ENCODE_BATCH):  # a pair too long is refused before the rest
            for index, encoding in enumerate(tokenizer.encode_batch(pairs[start : start + ENCODE_BATCH]), start):
                if len(encoding.ids) > self.max_tokens:  # only without truncation
                    raise ContextLengthError(
                        f"{second}[{index}] with its query has {len(encoding.ids)} tokens, more than this model's "
                        f"{self.max_tokens}; shorten it or ask for truncation",
                        param=second,
                    )
                result.append(Tokens(list(encoding.ids), list(encoding.type_ids)))
        return result

    async def score(
        self,
        queries: str | Sequence[str],
        documents: Sequence[str],
        *,
        truncate: bool | None = None,
        names: tuple[str, str] = ("query", "documents"),
    ) -> RerankResult:
        """Score each pair (see :meth:`tokenize_pairs`); concurrent calls share session runs."""
        # Off the event loop: a thousand long documents take a while to tokenize.
        pairs = await asyncio.to_thread(self.tokenize_pairs, queries, documents, truncate=truncate, names=names)
        logits = await self._submit(pairs)
        return RerankResult(self._activate(logits[:, 0]), [len(p.ids) for p in pairs])

    def score_sync(
        self,
        queries: str | Sequence[str],
        documents: Sequence[str],
        *,
        truncate: bool | None = None,
    ) -> RerankResult:
        """The same, for synchronous callers: one session run per batch, no merging."""
        pairs = self.tokenize_pairs(queries, documents, truncate=truncate)
        logits = np.stack(self._run_batches(pairs))
        return RerankResult(self._activate(logits[:, 0]), [len(p.ids) for p in pairs])

    def _reduce(self, hidden: npt.NDArray[np.float32], mask: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        return hidden  # the classifier's logits, one row per pair

    def _activate(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        if self.activation == "none":
            return np.ascontiguousarray(logits, dtype=np.float32)
        return np.asarray(1 / (1 + np.exp(-logits.astype(np.float64))), dtype=np.float32)


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    return read_json(path) if path.exists() else {}


def _num_labels(folder: Path) -> int:
    """From config.json (``num_labels``, else its ``id2label``); 1 when it says nothing."""
    config = _config(folder)
    value = config.get("num_labels")
    if isinstance(value, int):
        return value
    labels = config.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else 1


def _activation(folder: Path) -> Literal["sigmoid", "none"]:
    """The activation sentence-transformers' CrossEncoder applies to a one-label model:
    the one its config.json names (Sigmoid or Identity), else Sigmoid (its default)."""
    config = _config(folder)
    sections = [config.get("sentence_transformers"), config]
    named = next(
        (s[key] for s in sections if isinstance(s, dict) for key in _ACTIVATION_KEYS if isinstance(s.get(key), str)),
        None,
    )
    if named is None or named.endswith("Sigmoid"):
        return "sigmoid"
    if named.endswith("Identity"):
        return "none"
    raise ModelLoadError(
        f"{folder / 'config.json'} names the activation {named!r}; rerank models apply Sigmoid or Identity "
        "(set RerankConfig.activation to choose one)",
        path=folder / "config.json",
    )
