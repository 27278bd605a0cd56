"""Embedding models: an ONNX encoder plus ``tokenizer.json``, with a micro-batcher.

Concurrent ``embed`` calls are merged into few session runs: a worker thread takes what
has arrived within ``max_wait_ms`` (up to ``max_batch_size`` inputs per run), sorts it by
token length so that a batch pads little, runs onnxruntime off the event loop and hands
each caller its own rows back in input order. Inputs are checked one by one, so an input
that is too long fails only its own request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Tokenizer

from ._config import ModelConfig
from ._errors import ContextLengthError, EngineClosedError, InvalidRequestError, ModelLoadError
from ._providers import check_session_provider, ort_providers
from ._threads import resolve_future

__all__ = ["EmbeddingInput", "EmbeddingModel", "EmbeddingResult", "Pooling"]

Pooling = Literal["mean", "cls", "last"]
EmbeddingInput = str | Sequence[str | int | Sequence[int]]
"""One text, texts, one list of token ids, or lists of token ids (not mixed)."""
_ONNX_CANDIDATES = ("model.onnx", "onnx/model.onnx")
_ALLOW_SPINNING = "session.intra_op.allow_spinning"

log = logging.getLogger("ortserve.runtime")


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """One request's vectors (rows in input order) and token counts."""

    vectors: npt.NDArray[np.float32]
    token_counts: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


@dataclass(eq=False)
class _Job:
    ids: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: Any  # an asyncio.Future of the caller's loop


class EmbeddingModel:
    """A sentence embedding model served with micro-batching (see the module docstring)."""

    kind: Literal["embedding"] = "embedding"

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        self.name = name
        self.folder = folder
        settings = config.embeddings
        self.normalize = settings.normalize
        self.truncate = settings.truncate
        self.max_batch_size = settings.max_batch_size
        self.max_inputs = settings.max_inputs
        self.run_tokens = settings.run_tokens
        self.max_wait = settings.max_wait_ms / 1000
        model_path = next((folder / c for c in _ONNX_CANDIDATES if (folder / c).exists()), None)
        if model_path is None:
            raise ModelLoadError(f"{folder} has no model.onnx (or onnx/model.onnx)", path=folder)
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.exists():
            if (folder / "tokenizer.model").exists():
                raise ModelLoadError(
                    f"{folder} has only a SentencePiece tokenizer.model; embedding models need tokenizer.json "
                    "(convert it with transformers: AutoTokenizer.from_pretrained(...).save_pretrained(...))",
                    path=folder / "tokenizer.model",
                )
            raise ModelLoadError(f"{tokenizer_path} does not exist", path=tokenizer_path)
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise ModelLoadError(f"{tokenizer_path} is not a valid tokenizer: {exc}", path=tokenizer_path) from exc
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.max_tokens = _max_tokens(folder)
        self.pooling: Pooling = settings.pooling or _pooling_mode(folder)
        self.session = _create_session(model_path, folder, config)
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "input_ids" not in inputs:
            raise ModelLoadError(f"{model_path} has no input_ids input; not a text encoder", path=model_path)
        self._input_names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in inputs]
        self._int_type = np.int32 if inputs["input_ids"].type == "tensor(int32)" else np.int64
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
            raise ModelLoadError(f"{model_path} has no hidden-state or embedding output", path=model_path)
        self.dimension = dims[-1] if isinstance(dims[-1], int) else self._probe_dimension()
        self.runs = 0
        """Session runs so far: fewer than requests when micro-batching merges them."""
        self._pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        # As ChatModel's max_prompt_chars: no token spans more characters than the longest
        # in the vocabulary, and a normaliser composes at most 3 into one. A text longer
        # than this is over the limit whatever its tokens; it is cut or refused untokenized.
        longest = max((len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.max_input_chars = self.max_tokens * max(longest, 1) * 3
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._serving = 0
        """Requests in the session runs under way (worker thread writes, anyone reads)."""
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"ortserve-embed-{name}", daemon=True)
        self._worker.start()

    # -- public API ------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests in the session runs under way."""
        return self._serving

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
        encoded = (
            dict(zip((i for i, _ in texts), self.tokenizer.encode_batch([t for _, t in texts]), strict=True))
            if texts
            else {}
        )
        result: list[list[int]] = []
        for index, item in enumerate(items):
            ids = list(encoded[index].ids) if isinstance(item, str) else [int(t) for t in item]
            if not ids:
                raise InvalidRequestError(f"input[{index}] has no tokens", param="input")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"input[{index}] has token id {bad[0]} outside the vocabulary", param="input")
            if len(ids) > self.max_tokens:
                if not cut:
                    raise ContextLengthError(
                        f"input[{index}] has {len(ids)} tokens, more than this model's {self.max_tokens}; "
                        "shorten it or ask for truncation",
                        param="input",
                    )
                ids = ids[: self.max_tokens - 1] + ids[-1:] if isinstance(item, str) else ids[: self.max_tokens]
            result.append(ids)
        return result

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
        if self._closed:
            raise EngineClosedError(f"model {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        job = _Job(ids=ids, loop=loop, future=loop.create_future())
        with self._waiting_lock:
            self._waiting += len(ids)
        self._queue.put(job)
        vectors: npt.NDArray[np.float32] = await job.future
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
        rows = self._run_batches(ids)
        return EmbeddingResult(self._finish(np.stack(rows), dimensions), [len(x) for x in ids])

    def batches(self, inputs: int) -> int:
        """Session runs of up to ``max_batch_size`` inputs that ``inputs`` inputs make."""
        return -(-inputs // self.max_batch_size)

    @property
    def queued(self) -> int:
        """Batches' worth of inputs handed to the batcher and not embedded yet."""
        return self.batches(self._waiting)

    async def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._worker.join)

    # -- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            jobs = [job]
            count = len(job.ids)
            deadline = time.monotonic() + self.max_wait
            while count < self.max_batch_size:
                try:
                    more = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
                count += len(more.ids)
            self._serving = len(jobs)
            try:
                self._serve(jobs)
            finally:
                self._serving = 0
        while not self._queue.empty():  # fail anything that raced with close()
            job = self._queue.get_nowait()
            if job is not None:
                resolve_future(job.loop, job.future, EngineClosedError(f"model {self.name!r} was closed"))

    def _serve(self, jobs: list[_Job]) -> None:
        flat = [ids for job in jobs for ids in job.ids]
        try:
            rows = self._run_batches(flat)
        except Exception as exc:  # noqa: BLE001  # an onnxruntime failure fails these requests only
            for job in jobs:
                resolve_future(job.loop, job.future, exc)
            return
        finally:
            with self._waiting_lock:
                self._waiting -= len(flat)
        start = 0
        for job in jobs:
            resolve_future(job.loop, job.future, np.stack(rows[start : start + len(job.ids)]))
            start += len(job.ids)

    def _run_batches(self, ids: list[list[int]]) -> list[npt.NDArray[np.float32]]:
        """Pooled vectors for ``ids`` in order.

        Inputs are sorted by length and cut into session runs of at most
        ``run_tokens`` padded tokens: padding is wasted work, and on a CPU small batches
        of similar length beat one large padded batch (measured: 1.8x for 32 sentences
        of 4 to 40 words in runs of 4 instead of one run of 32).
        """
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[npt.NDArray[np.float32] | None] = [None] * len(ids)
        chunk: list[int] = []
        for index in [*order, -1]:
            if chunk and (index < 0 or (len(chunk) + 1) * len(ids[index]) > self.run_tokens):
                pooled = self._forward([ids[i] for i in chunk])
                for row, position in enumerate(chunk):
                    out[position] = pooled[row]
                chunk = []
            chunk.append(index)
        return [v for v in out if v is not None]

    def _forward(self, batch: list[list[int]]) -> npt.NDArray[np.float32]:
        width = max(len(x) for x in batch)
        input_ids = np.full((len(batch), width), self._pad_id, dtype=self._int_type)
        mask = np.zeros((len(batch), width), dtype=self._int_type)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        feeds = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(input_ids)}
        (output,) = self.session.run([self._output], {name: feeds[name] for name in self._input_names})
        self.runs += 1
        hidden = np.asarray(output, dtype=np.float32)
        if self._pre_pooled:
            return hidden
        if self.pooling == "cls":
            return np.asarray(hidden[:, 0], dtype=np.float32)
        if self.pooling == "last":
            lengths = mask.sum(axis=1) - 1
            return np.asarray(hidden[np.arange(len(batch)), lengths], dtype=np.float32)
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
        return int(self._forward([[self._pad_id]]).shape[-1])


def _create_session(model_path: Path, folder: Path, config: ModelConfig) -> ort.InferenceSession:
    """An ``InferenceSession`` on ``config.provider``, or :class:`ModelLoadError`: a provider
    this onnxruntime lacks, or one the session was built without (OpenVINO drops itself on
    an option it rejects and leaves a CPU-only session), never runs silently on the CPU."""
    providers = ort_providers(config.provider, config.provider_options, folder)
    options = ort.SessionOptions()
    if config.intra_op_threads is not None:
        options.intra_op_num_threads = config.intra_op_threads
    entries = dict(config.session_options)
    if config.provider != "cpu":
        # Nodes the accelerator does not take run on the CPU provider, whose spinning
        # intra-op threads then compete with the accelerator's own (OpenVINO's CPU plugin
        # runs its own pool): on 2 cores spinning made mixed sessions slower. The user's
        # own setting wins.
        entries.setdefault(_ALLOW_SPINNING, "0")
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    started = time.perf_counter()
    if config.provider != "cpu":
        # OpenVINO (and TensorRT) compile the graph while the session is created: seconds,
        # which would otherwise look like a hang.
        log.info("compiling %s for %s", model_path, config.provider)
    try:
        session = ort.InferenceSession(str(model_path), options, providers=providers)
    except Exception as exc:  # onnxruntime's own untyped errors for corrupt files and bad provider options
        where = "" if config.provider == "cpu" else f" on provider {config.provider!r}"
        raise ModelLoadError(f"{model_path} could not be loaded by onnxruntime{where}: {exc}", path=model_path) from exc
    check_session_provider(session, config.provider, folder)
    if config.provider != "cpu":
        log.info(
            "compiled %s for %s in %.1f s (providers %s)",
            model_path,
            config.provider,
            time.perf_counter() - started,
            ", ".join(session.get_providers()),
        )
    return session


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


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}", path=path) from exc
    return data if isinstance(data, dict) else {}


def _pooling_mode(folder: Path) -> Pooling:
    """From sentence-transformers' 1_Pooling/config.json; mean when absent."""
    config_path = folder / "1_Pooling" / "config.json"
    if config_path.exists():
        config = _read(config_path)
        if config.get("pooling_mode_cls_token"):
            return "cls"
        if config.get("pooling_mode_lasttoken"):
            return "last"
    return "mean"


def _max_tokens(folder: Path) -> int:
    """sentence_bert_config.json, else the tokenizer's limit, else 512."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        path = folder / name
        if path.exists():
            value = _read(path).get(key)
            if isinstance(value, int) and 0 < value < 1_000_000:
                return value
    return 512
