"""What embedding and rerank models share: an ONNX encoder plus ``tokenizer.json``, run
by a micro-batcher.

Concurrent calls are merged into few session runs: a worker thread takes what has
arrived within ``max_wait_ms`` (up to ``max_batch_size`` inputs per run), sorts it by
token length so that a batch pads little, runs onnxruntime off the event loop and hands
each caller its own rows back in input order. Subclasses say which output they read and
how a batch's output becomes one row per input (:meth:`BatchedEncoder._reduce`).

A large request does not hold the worker: each request's inputs are cut into runs of at
most ``run_tokens`` padded tokens, and the worker takes one run's worth of every request
in turn (small requests' inputs merged into shared runs), so a request arriving behind a
2,048-input one waits one such round, not the whole of it. A caller that stops waiting
(a client gone: the server cancels the awaiting task) has its remaining runs dropped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from tokenizers import Tokenizer

from .._config import ModelConfig
from .._contract import resolve_future
from .._errors import EngineClosedError, ModelLoadError
from .._model_files import MAX_TOKENIZER_BYTES, checked_file, read_json_file
from .._providers import check_session_provider, ort_providers
from .._text_bounds import TextLimit

__all__ = ["ENCODE_BATCH", "BatchedEncoder", "Tokens", "create_session", "read_json"]

ENCODE_BATCH = 64
"""Texts (or pairs) tokenized at once, each checked as soon as it is: their encodings (ids,
offsets, token strings) are some 150 bytes a token, so 64 of the longest texts a model
takes hold tens of MiB, not hundreds."""

_ONNX_CANDIDATES = ("model.onnx", "onnx/model.onnx")
_ALLOW_SPINNING = "session.intra_op.allow_spinning"

log = logging.getLogger("ortserve.runtime")


@dataclass(frozen=True, slots=True)
class Tokens:
    """One input as the encoder takes it: token ids and, for a pair, their token types
    (``None``: all 0, one segment)."""

    ids: list[int]
    type_ids: list[int] | None = None


@dataclass(eq=False)
class _Job:
    inputs: list[Tokens]
    loop: asyncio.AbstractEventLoop
    future: Any  # an asyncio.Future of the caller's loop
    chunks: list[list[int]] | None = None
    """Its inputs' indices, shortest first, cut into runs (set by the worker)."""
    rows: list[npt.NDArray[np.float32] | None] | None = None
    """Its output rows so far, in input order."""


class BatchedEncoder:
    """An encoder session, its tokenizer and the micro-batcher (see the module docstring).

    A subclass calls ``super().__init__``, picks its output (``self._output``), then
    :meth:`_start`; it implements :meth:`_reduce`.
    """

    kind_label = "encoder"
    """What the subclass serves, for load errors (``embedding``, ``rerank``)."""

    def __init__(
        self,
        name: str,
        folder: Path,
        config: ModelConfig,
        *,
        max_batch_size: int,
        run_tokens: int,
        max_wait_ms: float,
    ) -> None:
        self.name = name
        self.folder = folder
        self.max_batch_size = max_batch_size
        self.run_tokens = run_tokens
        self.max_wait = max_wait_ms / 1000
        model_path = next((folder / c for c in _ONNX_CANDIDATES if (folder / c).exists()), None)
        if model_path is None:
            raise ModelLoadError(f"{folder} has no model.onnx (or onnx/model.onnx)", path=folder)
        self.model_path = model_path
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.exists():
            if (folder / "tokenizer.model").exists():
                raise ModelLoadError(
                    f"{folder} has only a SentencePiece tokenizer.model; {self.kind_label} models need tokenizer.json "
                    "(convert it with transformers: AutoTokenizer.from_pretrained(...).save_pretrained(...))",
                    path=folder / "tokenizer.model",
                )
            raise ModelLoadError(f"{tokenizer_path} does not exist", path=tokenizer_path)
        checked_file(tokenizer_path, MAX_TOKENIZER_BYTES)
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise ModelLoadError(f"{tokenizer_path} is not a valid tokenizer: {exc}", path=tokenizer_path) from exc
        # The pad token: from the tokenizer's own padding settings, else by its usual names
        # (BERT's [PAD], RoBERTa's and XLM-R's <pad>, which is id 1 there, not 0).
        padding = self.tokenizer.padding
        named = (self.tokenizer.token_to_id(token) for token in ("[PAD]", "<pad>"))
        self._pad_id: int = padding["pad_id"] if padding else next((i for i in named if i is not None), 0)
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.max_tokens = _max_tokens(folder)
        self.session = create_session(model_path, folder, config)
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "input_ids" not in inputs:
            raise ModelLoadError(f"{model_path} has no input_ids input; not a text encoder", path=model_path)
        self._input_names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in inputs]
        self._int_type = np.int32 if inputs["input_ids"].type == "tensor(int32)" else np.int64
        self._output = ""
        """The session output :meth:`_reduce` reads (the subclass picks it)."""
        self.runs = 0
        """Session runs so far: fewer than requests when micro-batching merges them."""
        self._input_limit = TextLimit(self.tokenizer, self.max_tokens)
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._serving = 0
        """Requests in the session runs under way (worker thread writes, anyone reads)."""
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"ortserve-{self.kind_label}-{name}", daemon=True)

    @property
    def max_input_chars(self) -> int:
        """Characters an input may have before it is tokenized: a longer one is over the
        limit whatever its tokens, and is cut or refused untokenized (see :class:`TextLimit`)."""
        return self._input_limit.chars()

    def _start(self) -> None:
        self._worker.start()

    # -- public API ------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests in the session runs under way."""
        return self._serving

    def batches(self, inputs: int) -> int:
        """Session runs of up to ``max_batch_size`` inputs that ``inputs`` inputs make."""
        return -(-inputs // self.max_batch_size)

    @property
    def queued(self) -> int:
        """Batches' worth of inputs handed to the batcher and not run yet."""
        return self.batches(self._waiting)

    async def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._worker.join)

    # -- for subclasses --------------------------------------------------------------------

    async def _submit(self, inputs: list[Tokens]) -> npt.NDArray[np.float32]:
        """The rows of ``inputs``, in order, from session runs shared with concurrent callers."""
        if self._closed:
            raise EngineClosedError(f"model {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        job = _Job(inputs=inputs, loop=loop, future=loop.create_future())
        with self._waiting_lock:
            self._waiting += len(inputs)
        self._queue.put(job)
        rows: npt.NDArray[np.float32] = await job.future
        return rows

    def _reduce(self, hidden: npt.NDArray[np.float32], mask: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
        """One row per input of a batch from the session output (``mask``: 1 on real tokens)."""
        raise NotImplementedError

    # -- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        active: list[_Job] = []
        while True:
            arrived = self._collect(wait=not active)
            if arrived is None:
                break
            for job in arrived:
                job.chunks = self._chunks(job.inputs)
                job.rows = [None] * len(job.inputs)
            active += arrived
            active = [job for job in active if not self._dropped(job)]
            if not active:
                continue
            # One round: the next run's worth of each request (see the module docstring).
            taken = [(job, job.chunks.pop(0)) for job in active if job.chunks]
            self._serving = len(taken)
            try:
                self._serve_round(taken)
            finally:
                self._serving = 0
            active = [job for job in active if job.chunks and not job.future.done()]
        while not self._queue.empty():  # fail anything that raced with close()
            late = self._queue.get_nowait()
            if late is not None:
                active.append(late)
        for job in active:
            resolve_future(job.loop, job.future, EngineClosedError(f"model {self.name!r} was closed"))

    def _collect(self, *, wait: bool) -> list[_Job] | None:
        """Requests that arrived: with nothing under way, the first one waited for and then
        what comes within ``max_wait`` (up to ``max_batch_size`` inputs), else those already
        queued; ``None`` once closed."""
        jobs: list[_Job] = []
        count = 0
        if wait:
            first = self._queue.get()
            if first is None:
                return None
            jobs.append(first)
            count = len(first.inputs)
        deadline = time.monotonic() + (self.max_wait if wait else 0.0)
        while count < self.max_batch_size:
            more: _Job | None
            try:
                more = (
                    self._queue.get(timeout=max(0.0, deadline - time.monotonic())) if wait else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if more is None:
                self._queue.put(None)
                break
            jobs.append(more)
            count += len(more.inputs)
        return jobs

    def _dropped(self, job: _Job) -> bool:
        """Whether ``job``'s caller stopped waiting (its future was cancelled): its runs not
        taken yet are dropped."""
        if not job.future.done():
            return False
        with self._waiting_lock:
            self._waiting -= sum(len(chunk) for chunk in job.chunks or [])
        job.chunks = []
        return True

    def _chunks(self, inputs: list[Tokens]) -> list[list[int]]:
        """Indices of ``inputs``, shortest first, cut into runs of at most ``run_tokens``
        padded tokens (an input longer than that runs alone).

        Padding is wasted work, and on a CPU small batches of similar length beat one large
        padded batch (measured: 1.8x for 32 sentences of 4 to 40 words in runs of 4
        instead of one run of 32).
        """
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].ids))
        chunks: list[list[int]] = []
        chunk: list[int] = []
        for index in order:
            if chunk and (len(chunk) + 1) * len(inputs[index].ids) > self.run_tokens:
                chunks.append(chunk)
                chunk = []
            chunk.append(index)
        return [*chunks, chunk] if chunk else chunks

    def _serve_round(self, taken: list[tuple[_Job, list[int]]]) -> None:
        """Run one chunk of each job (chunks merged where they fit one run together) and
        hand each job its rows once it has all of them."""
        flat = [job.inputs[index] for job, chunk in taken for index in chunk]
        try:
            rows = self._run_batches(flat)
        except Exception as exc:  # noqa: BLE001  # an onnxruntime failure fails these requests only
            for job, _ in taken:
                job.chunks = []
                resolve_future(job.loop, job.future, exc)
            return
        finally:
            with self._waiting_lock:
                self._waiting -= len(flat)
        position = 0
        for job, chunk in taken:
            assert job.rows is not None
            for index in chunk:
                job.rows[index] = rows[position]
                position += 1
            if not job.chunks:
                resolve_future(job.loop, job.future, np.stack([row for row in job.rows if row is not None]))

    def _run_batches(self, inputs: list[Tokens]) -> list[npt.NDArray[np.float32]]:
        """Rows for ``inputs`` in order, from the session runs :meth:`_chunks` cuts them into."""
        out: list[npt.NDArray[np.float32] | None] = [None] * len(inputs)
        for chunk in self._chunks(inputs):
            reduced = self._forward([inputs[i] for i in chunk])
            for row, position in enumerate(chunk):
                out[position] = reduced[row]
        return [v for v in out if v is not None]

    def _forward(self, batch: list[Tokens]) -> npt.NDArray[np.float32]:
        width = max(len(x.ids) for x in batch)
        input_ids = np.full((len(batch), width), self._pad_id, dtype=self._int_type)
        mask = np.zeros((len(batch), width), dtype=self._int_type)
        types = np.zeros((len(batch), width), dtype=self._int_type)
        for row, item in enumerate(batch):
            input_ids[row, : len(item.ids)] = item.ids
            mask[row, : len(item.ids)] = 1
            if item.type_ids is not None:
                types[row, : len(item.type_ids)] = item.type_ids
        feeds = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": types}
        (output,) = self.session.run([self._output], {name: feeds[name] for name in self._input_names})
        self.runs += 1
        return self._reduce(np.asarray(output, dtype=np.float32), mask)


def create_session(model_path: Path, folder: Path, config: ModelConfig) -> ort.InferenceSession:
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


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or :class:`ModelLoadError` naming it."""
    data = read_json_file(path)
    return data if isinstance(data, dict) else {}


def _max_tokens(folder: Path) -> int:
    """sentence_bert_config.json, else the tokenizer's limit, else 512."""
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        path = folder / name
        if path.exists():
            value = read_json(path).get(key)
            if isinstance(value, int) and 0 < value < 1_000_000:
                return value
    return 512
