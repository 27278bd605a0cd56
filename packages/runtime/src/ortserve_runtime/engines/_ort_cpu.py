"""``ort-cpu``: continuous batching of the genai builder's decoder graph on onnxruntime's
CPU provider.

Why not ``og.Engine`` or a batched ``og.Generator`` on the CPU (measured with
onnxruntime-genai 0.18, see docs/performance.md): the static Engine batches at most 4 requests and a
new request waits for the whole batch; a batched Generator takes every prompt at once and
its left padding gives wrong results for the padded rows of GQA models. So the decoder ONNX
graph the genai builder writes is driven directly with onnxruntime:

* one owner thread per model runs every session call; asyncio callers never block;
* each request owns one row of a key/value cache shared between past and present
  (GroupQueryAttention's share-buffer mode, as onnxruntime-genai does it), so a request
  joins the running batch after its own prefill and leaves it the step it finishes or is
  cancelled, freeing its row at once (continuous batching);
* sampling, stop strings and EOS handling run per request on the host, so requests with
  different options share one batch.

LongRoPE models (Phi-3.x, Phi-4-mini) take the short or the long rotary factors at each
call from the attention mask's width (see :func:`_longrope_window`), so the engine shapes its
calls as onnxruntime-genai's do: a prompt past the window in one call (the rest of it,
after a prefix-cache hit), a decode step per side of the window, and prefix-cache entries
reused only by prompts on their own side.

LoRA adapters (see :func:`_adapter_inputs`) are bound as extra inputs, one adapter per
session call: the rows are kept grouped by adapter (see :meth:`OrtCpuEngine._regroup`), so
a decode step makes one call per adapter in use, each batching all of that adapter's rows.

A prompt to score (``GenerationOptions.prompt_logprobs``: completions' ``echo``) is
prefilled whole, past any prefix-cache hit (a cached prefix has no logits), by the exact
graph rather than the int8 prefill copy, with every position's logits computed
(``LOGIT_POSITIONS`` set to them all) in chunks whose logits stay within
:data:`_SCORED_LOGITS_BYTES`; each position scores the prompt token after it.

Long on purpose (over 600 lines): :class:`OrtCpuEngine` is one scheduler. Its methods share
the batch's rows, the key/value cache, the prefix cache and the adapter groups on the owner
thread, and each step's choices (prefill, refill, preempt, regroup, speculate) read and
change all of them; split apart, they would hand that state to each other. What stands
alone lives beside it: the graph and its sessions (``_decoder_graph``), the draft model
(``_draft_model``), host memory (``_host_memory``), the prefix cache, int8 prefill and
key/value storage.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx.helper
import onnx.numpy_helper
import onnxruntime as ort

from .._config import ModelConfig
from .._contract import EngineCapabilities, FinishReason, OwnerThread, Request, batched_hand_backs
from .._drafts import MAX_DRAFT_TOKENS
from .._errors import EngineError, ModelLoadError, PreemptedError
from .._folder import GenaiFolder
from .._memory import release_freed_memory
from ._decoder_graph import LAST_POSITION, LOGIT_POSITIONS, DecoderGraph, NotDrivableError
from ._draft_model import DraftModel, draft_length
from ._host_memory import give_back, unhuged_zeros
from ._int8_prefill import cpu_has_vnni, has_int4_matrices
from ._prefix_cache import PrefixCache, Rows

__all__ = ["NotDrivableError", "OrtCpuEngine"]

logger = logging.getLogger(__name__)


class OrtCpuEngine(OwnerThread):
    """Continuous batching on the CPU provider (see the module docstring)."""

    name = "ort-cpu"
    provider = "cpu"
    capabilities = EngineCapabilities(
        host_sampling=True,
        seeds=True,
        media=False,
        batching="continuous",
        reproducible=True,
        drafts=True,
        prompt_logprobs=True,
    )

    def __init__(
        self,
        model_name: str,
        folder: GenaiFolder,
        config: ModelConfig,
        max_sequence_length: int,
        adapters: Mapping[str, Path] | None = None,
    ) -> None:
        if config.provider != "cpu":
            raise ModelLoadError(
                f"the ort-cpu engine runs on the CPU provider only, not {config.provider!r}; "
                "use --engine og-engine or og-generator (or auto) for other providers",
                path=folder.path,
            )
        if folder.is_multimodal or folder.is_encoder_decoder:
            raise ModelLoadError(
                f"{folder.path} is a multimodal or encoder-decoder model ({folder.model_type}); "
                "the ort-cpu engine runs decoder-only text models (use og-generator)",
                path=folder.path,
            )
        super().__init__(model_name)
        self._graph = DecoderGraph(folder.path, folder.genai, config)
        self._draft = DraftModel(folder, config, max_sequence_length) if config.draft_folder is not None else None
        """The draft model of ``speculative="draft:FOLDER"``."""
        self._adapter_inputs = _adapter_inputs(adapters or {})
        """Adapter tensors by adapter key; replaced, never changed in place (see :meth:`add_adapter`)."""
        self._retired: set[str] = set()
        """Adapter keys to forget once no request uses them (see :meth:`retire_adapter`)."""
        self.max_batch_size = config.max_batch_size
        graph = self._graph
        # np.zeros maps untouched pages lazily: memory grows with the tokens actually cached.
        # A sliding layer's ring is a whole row too (it never wraps, so rows can be copied
        # like any other), but GQA refuses one shorter than the window.
        self._cache = []
        for layer, (heads, head_size) in enumerate(graph.layer_shapes):
            length = max(max_sequence_length, graph.window_size if layer in graph.window_layers else 0)
            shape = (self.max_batch_size, heads, length, head_size)
            self._cache.append((unhuged_zeros(shape, graph.cache_dtype), unhuged_zeros(shape, graph.cache_dtype)))
        self._rows_touched = 0
        """Rows written since their pages were last given back (see :meth:`_give_back_rows`)."""
        self._rows: list[Request] = []
        self._prefilling: Request | None = None
        """The request whose prompt is going into the cache, at row ``len(self._rows)``."""
        self._refills: collections.deque[_Refill] = collections.deque(maxlen=_REFILLS)
        """Finished requests whose prompt and reply are to be prefilled for the prefix cache
        while the engine is idle (see :meth:`_refill_step`); newest last."""
        self._refilling: _Refill | None = None
        """The refill going into row 0 now."""
        self._row0_tokens: tuple[str, npt.NDArray[np.int64]] | None = None
        """The cache group and tokens whose key/values cache row 0 holds unchanged since they
        last went to the prefix cache (copied out of it, or found there already): a request
        taking row 0 whose cache hit in that group is a prefix of these (a lone chat's next
        turn, a prompt sent again) finds it in place, and the copy back (4 ms for a
        600-token history of SmolLM2) is skipped. ``None`` once anything else writes row 0."""
        self._releasing = 0
        """Finished requests whose last event is out and whose rows are being released."""
        self.prefill_chunk = config.prefill_chunk_tokens
        self.kv_cache_dtype = np.dtype(graph.cache_dtype).name
        """What the key/value cache stores (``ModelConfig.kv_cache_dtype``, or the graph's type)."""
        token_bytes = 2 * sum(h * size for h, size in graph.layer_shapes) * np.dtype(graph.cache_dtype).itemsize
        self._token_bytes = token_bytes
        budget = config.prefix_cache_tokens
        if config.prefix_cache_mb is not None:
            budget = int(config.prefix_cache_mb * 2**20) // token_bytes
        self._even_calls = config.reproducible
        """Prefill in calls of an even number of rows (see :func:`_even_call`): what makes a
        prompt's rows a function of its tokens alone, at up to a token's work more a call."""
        self.prefix_cache = PrefixCache(
            budget, config.prefix_cache_min_tokens, token_bytes, even_calls=self._even_calls
        )
        """Key/value rows of earlier prompts (see _prefix_cache); owner thread only."""
        self._bindings: dict[tuple[int, int, str | None, int, bool], Any] = {}
        """IO bindings by row range, adapter, session and logits buffer (see :meth:`_bind`)."""
        self._logits = (
            unhuged_zeros((self.max_batch_size, 1, graph.vocab_size), graph.logits_dtype) if graph.last_only else None
        )
        """Where the decoder writes next-token logits, a row per cache row, when it computes
        the last position's only (their shape is then fixed)."""
        self._shrink_arena = ort.RunOptions()
        self._shrink_arena.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self.steps = 0
        """Decoder runs so far (prefills plus batched decode steps); for tests and metrics."""
        self.background_yields = 0
        """Times a background request gave way to an interactive one (its prefill parked, or
        its row given up); for tests and metrics."""
        self.prefixes_in_place = 0
        """Prefix-cache hits found in place in row 0 (see ``_row0_tokens``); for tests."""
        self.draft_tokens = 0
        """Draft tokens checked so far (speculative decoding, see :meth:`_speculate`)."""
        self.accepted_draft_tokens = 0
        """Draft tokens that became output tokens."""
        self.prefill_session: Any = None
        """The int8 prefill session, where ``ModelConfig.prefill_int8`` asks for one."""
        int4 = has_int4_matrices(graph.int8_source)
        convertible = graph.last_only and int4
        # The probe builds a session of its own (10 ms): asked only where its answer is used.
        self._pad_lone_row = config.reproducible and int4 and _lone_row_rounds_differently()
        """Decode a lone row beside a dummy (see :meth:`_decode_rows`); only on request
        (``ModelConfig.reproducible``), it costs a row's work every step."""
        self._keep_decoded = not config.reproducible
        """A finished request's reply rows, written by decode steps, go to the prefix cache
        as they are: a next turn sent at once finds its whole history there. Decode steps
        round differently from a prefill, so with ``reproducible`` on only prefilled rows
        are kept, and replies are prefilled again while the engine is idle (:meth:`_refill_step`)."""
        if config.prefill_int8 and not convertible:
            raise ModelLoadError(
                f"{folder.path}: prefill_int8 (--prefill-int8 on) needs an int4 model (4-bit MatMulNBits) whose "
                "logits are computed for the last position only; this one has nothing to convert "
                "(turn it off for this model, or use --prefill-int8 auto, which skips such models)",
                path=folder.path,
            )
        if config.prefill_int8 and not cpu_has_vnni():
            # Without VNNI onnxruntime's u8s8 GEMM adds u8 x s8 products in pairs in 16 bits
            # (AVX2's vpmaddubsw), which saturate: measured on an AVX2-only EPYC, a 72 x 24
            # product came out 14% off (of its largest value); and it would not be faster.
            raise ModelLoadError(
                f"{folder.path}: prefill_int8 (--prefill-int8 on) needs a CPU with VNNI (AVX-512 VNNI or "
                "AVX-VNNI), and this one has none: its int8 products would saturate; turn it off, or use "
                "--prefill-int8 auto, which turns it on where the CPU has VNNI",
                path=folder.path,
            )
        wanted = config.prefill_int8 if config.prefill_int8 is not None else cpu_has_vnni()
        if wanted and convertible:
            # Part of the load (seconds; the first load of a model also converts it), so that
            # the memory measured around the load counts it, and no later load's does.
            try:
                self.prefill_session = graph.open_int8_prefill()
            except Exception as exc:  # an unusual graph, a full disk
                if config.prefill_int8:  # asked for by name: a load error saying why, not a silent int4
                    raise ModelLoadError(
                        f"{folder.path}: prefill_int8 (--prefill-int8 on): no int8 copy could be made "
                        f"({type(exc).__name__}: {exc}); turn it off, or use --prefill-int8 auto, which serves "
                        "without it",
                        path=folder.path,
                    ) from exc
                logger.warning("model %r: no int8 prefill session, prompts prefill in int4", model_name, exc_info=True)
            finally:
                release_freed_memory()  # the conversion's buffers
            if self.prefill_session is None and config.prefill_int8:
                raise ModelLoadError(
                    f"{folder.path}: prefill_int8 (--prefill-int8 on): none of its int4 matrices could be read "
                    "for an int8 copy; turn it off, or use --prefill-int8 auto",
                    path=folder.path,
                )
        else:
            del graph.int8_source
        if self.prefill_session is not None or config.speculative is not None or self._keep_decoded:
            # int8 prefill: one activation scale per call, a row's rounding depends on the rows
            # beside it. Speculation: a request checks drafts while it runs alone, and a
            # draft's rows round as a prompt's do, a decode step's otherwise. Without
            # ``reproducible``: decode-written rows serve later prompts, and (where the CPU
            # rounds a lone int4 row apart) a lone row runs without its dummy.
            self.capabilities = dataclasses.replace(self.capabilities, reproducible=False)
        self._start_thread()

    def add_adapter(self, key: str, path: Path) -> None:
        """Make LoRA adapter ``key`` (a checked ``.onnx_adapter`` file) usable by requests
        submitted from now on; any thread. The table is replaced, not changed in place, so
        the owner thread reads either table whole."""
        self._adapter_inputs = {**self._adapter_inputs, **_adapter_inputs({key: path})}

    def retire_adapter(self, key: str) -> None:
        """Forget adapter ``key`` once the requests using it are over (they finish with it);
        any thread. Keys are never reused (the model gives a re-added name a new key), so no
        binding or prefix-cache row of the old adapter can serve a new one."""
        with self._cond:
            self._retired.add(key)
            self._cond.notify()

    def _forget_retired_adapters(self) -> None:
        """Owner thread, under the lock: drop retired adapters no request holds any more."""
        held = [*self._inbox, *self._rows, *([self._prefilling] if self._prefilling else [])]
        in_use = {request.adapter for request in held}
        gone = self._retired - in_use
        if gone:
            self._adapter_inputs = {k: v for k, v in self._adapter_inputs.items() if k not in gone}
            for binding in [b for b in self._bindings if b[2] in gone]:
                del self._bindings[binding]
        self._retired &= in_use

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache's full capacity (its pages become resident as tokens are cached)."""
        return sum(key.nbytes + value.nbytes for key, value in self._cache)

    @property
    def live_kv_bytes(self) -> int:
        """Key/value bytes the running requests' rows hold (their tokens so far)."""
        held = [*self._rows, *([self._prefilling] if self._prefilling is not None else [])]
        return sum(request.length for request in held) * self._token_bytes

    @property
    def active(self) -> int:
        """Requests decoding or having their prompt prefilled now (not one whose last event
        is out and whose row is being released)."""
        return len(self._rows) + (self._prefilling is not None) - self._releasing

    @property
    def refilling(self) -> bool:
        """Whether finished replies are still to go into the prefix cache (see
        :meth:`_refill_step`): until then a next turn prefills them itself."""
        return bool(self._refills) or self._refilling is not None or self._releasing > 0

    # -- owner thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._has_work() or self._closing):
                    self._cond.wait()
                if self._closing:
                    break
                if self._retired:
                    self._forget_retired_adapters()
                cancels, self._cancels = self._cancels, set()
                for request in cancels:
                    if request in self._inbox:
                        self._inbox.remove(request)
                        request.deliver(request.final("cancelled"))
            for request in cancels:
                if request is self._prefilling:
                    self._prefilling, request.row = None, -1
                    request.deliver(request.final("cancelled"))
                elif request.row >= 0:
                    self._finish(request, "cancelled")
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001  # an onnxruntime failure: fail the requests it touched
                failed = [*self._rows, *([self._prefilling] if self._prefilling else [])]
                self._prefilling = self._refilling = self._row0_tokens = None
                self.prefix_cache.clear()  # a failed run may have left rows half written
                for request in failed:
                    if request in self._rows:
                        self._release(request, keep=False)
                    request.row = -1
                    request.deliver(EngineError(f"generation failed: {exc}"))
        error = self._closed_error()
        for request in [*self._inbox, *self._rows, *([self._prefilling] if self._prefilling else [])]:
            request.deliver(error)
        self._inbox.clear()
        self._rows.clear()
        self._prefilling = None

    def _has_work(self) -> bool:
        return bool(
            self._inbox
            or self._rows
            or self._prefilling
            or self._cancels
            or self._retired
            or self._refills
            or self._refilling
        )

    def _step(self) -> None:
        """One turn of the engine: prefill what waits, then a decode step of the running
        requests, or, with nothing else to do, a chunk of a refill."""
        if self._refilling is not None and self._inbox:
            self._stop_refill()  # a request came: it takes the row
        self._prefill_work()  # first tokens go out as each prompt is done
        if self._rows:
            with batched_hand_backs():  # one event-loop wake-up for the whole step
                self._decode_step()
        elif self._prefilling is None and not self._inbox and (self._refilling or self._refills):
            self._refill_step()

    def _prefill_work(self) -> None:
        """Put waiting prompts into the cache, one chunk at a time.

        Prompts that fit in a chunk are admitted back to back (low time to first token
        when many arrive together). A longer prompt takes one chunk per engine step, with
        a decode step of the running requests in between, so their streams keep flowing.
        """
        while True:
            if self._prefilling is not None and self._prefilling.options.background:
                self._park_background_prefill()
            if self._prefilling is None:
                with self._cond:
                    waiting = self._inbox[0] if self._inbox and len(self._rows) >= self.max_batch_size else None
                if waiting is not None and not waiting.options.background:
                    self._preempt_background()
                with self._cond:
                    if not self._inbox or len(self._rows) >= self.max_batch_size:
                        return
                    request = self._inbox.popleft()
                if request.cancelled:
                    request.deliver(request.final("cancelled"))
                    continue
                if request.adapter is not None and request.adapter not in self._adapter_inputs:
                    # submitted with an adapter unloaded meanwhile (a retired one waits for
                    # the requests already here): this request alone fails
                    request.deliver(EngineError(f"LoRA adapter {request.adapter!r} was unloaded"))
                    continue
                request.row, request.prefilled = len(self._rows), 0
                request.admit()
                self._rows_touched = max(self._rows_touched, request.row + 1)
                if request.prompt_scores is None:
                    # A prompt to score is prefilled whole: a cached prefix has no logits.
                    self._reuse_prefix(request)
                if request.row == 0:
                    self._row0_tokens = None  # its prefill writes row 0 from here on
                self._prefilling = request
            request = self._prefilling
            logits = self._prefill_chunk(request, _BACKGROUND_CHUNK if request.options.background else None)
            if logits is None:
                if self._rows:
                    return  # a long prompt: let the running requests take a step
                continue
            self._prefilling = None
            self._rows.append(request)
            if request.max_tokens == 0:  # the prompt scored, nothing to generate
                self._finish(request, "length")
            else:
                self._accept(request, logits)
            if request.row >= 0:  # after its first token went out (a copy: milliseconds)
                self._remember(request)  # others may share this prompt's beginning

    def _park_background_prefill(self) -> None:
        """An interactive request waits while a background prompt goes in: the background one
        goes back to the queue behind it, what it prefilled kept in the prefix cache (its next
        turn starts from there), so the interactive prompt waits one chunk at most."""
        request = self._prefilling
        with self._cond:
            if request is None or not self._inbox or self._inbox[0].options.background:
                return
        if request.prefilled:
            self._remember(request, request.prefilled)
        self._prefilling, request.row = None, -1
        self.background_yields += 1
        with self._cond:
            first = next((i for i, queued in enumerate(self._inbox) if queued.options.background), len(self._inbox))
            self._inbox.insert(first, request)

    def _preempt_background(self) -> None:
        """Free a row for an interactive request that waits with every row taken: the
        background request with the fewest tokens so far gives its row up (its prompt stays
        in the prefix cache for its next run)."""
        victims = [request for request in self._rows if request.options.background]
        if not victims:
            return
        victim = min(victims, key=lambda request: len(request.tokens))
        victim.cancelled = True  # no refill of a reply nobody gets
        self._release(victim)
        self.background_yields += 1
        victim.deliver(PreemptedError(f"model {self.model_name!r}: gave its batch row to an interactive request"))

    def _refill_step(self) -> None:
        """While nothing else runs: prefill one chunk of the newest finished request's prompt
        and reply, and keep them in the prefix cache once done.

        A reply's key/values are written by decode steps and never kept (see _prefix_cache),
        so a chat's next turn would prefill the reply again before its first token. Done
        here, while the user reads the reply, the next turn finds it in the cache as a cold
        prefill would have computed it. Small chunks, so that a request arriving meanwhile
        waits one chunk at most; it then takes the row, and what was prefilled so far is
        kept (:meth:`_stop_refill`). LongRoPE models get none: a prompt and reply past the
        window would need one call from the first token (see :meth:`_prefill_chunk`).
        """
        refill = self._refilling or self._refills.pop()
        if refill.adapter is not None and refill.adapter not in self._adapter_inputs:
            self._refilling = None  # its adapter was unloaded (checked each chunk: it may go between two)
            return
        if refill is not self._refilling:
            self._refilling = refill
            refill.row = 0
            self._rows_touched = max(self._rows_touched, 1)
            self._reuse_prefix(refill, count=False)
            self._row0_tokens = None
        if self._prefill_chunk(refill, _REFILL_CHUNK) is not None:
            self._refilling = None
            self._remember(refill)
            self._give_back_rows(0)

    def _stop_refill(self) -> None:
        """Give the row of the refill under way to a request; keep what it prefilled."""
        refill, self._refilling = self._refilling, None
        if refill is not None and refill.prefilled > 0:
            self._remember(refill, refill.prefilled)

    def _past_window(self, length: int) -> bool:
        """Whether a call whose attention mask is ``length`` wide uses LongRoPE's long factors."""
        window = self._graph.rope_window
        return window is not None and length > window

    def _call_group(self, request: Request) -> tuple[bool, str]:
        """Rows decoded in one session call share this: the LongRoPE side (rows within the
        window sort first), and the adapter (``""``: the base model)."""
        return self._past_window(request.length), request.adapter or ""

    def _cache_group(self, request: Request | _Refill) -> str:
        """The prefix-cache group of ``request``'s row: og computes a LongRoPE prompt past the
        window with the long factors throughout, one within it with the short ones;
        key/values computed through an adapter serve only that adapter; and those of a
        request with a ``cache_salt`` only requests with the same salt."""
        rope = "long-rope" if self._past_window(len(request.prompt)) else ""
        group = f"{rope}:{request.adapter}" if request.adapter is not None else rope
        salt = request.cache_salt if isinstance(request, _Refill) else request.options.cache_salt
        if salt is not None:  # kept as a digest: the cache holds no caller's secret
            group += ":salt:" + hashlib.sha256(salt.encode()).hexdigest()
        return group

    def _reuse_prefix(self, request: Request | _Refill, *, count: bool = True) -> None:
        """Copy the longest cached prefix of ``request``'s prompt into its row, unless the row
        holds it already (see ``_row0_tokens``; ``count``: in the cache's hit and miss figures)."""
        if self._even_calls and self._odd_long_rope(request):
            return  # its last row is computed alone in a block (see _odd_long_rope): always cold
        group = self._cache_group(request)
        entry, length = self.prefix_cache.lookup(request.prompt, group, count=count)
        if entry is None:
            return
        held = self._row0_tokens
        in_place = (
            request.row == 0
            and held is not None
            and held[0] == group
            and len(held[1]) >= length
            and np.array_equal(held[1][:length], request.prompt[:length])
        )
        self.prefixes_in_place += in_place
        if not in_place:
            for (keys, values), (cached_keys, cached_values) in zip(self._cache, entry.rows, strict=True):
                keys[request.row, :, :length] = cached_keys[:, :length]
                values[request.row, :, :length] = cached_values[:, :length]
        request.prefilled = request.cached_tokens = length

    def _odd_long_rope(self, request: Request | _Refill) -> bool:
        """Whether ``request``'s prompt is past LongRoPE's window by one token, and odd: the
        only prompt that cannot be prefilled in calls of an even number of rows (see
        :func:`_even_call`), since any first call shorter than the whole prompt would be
        within the window. Its last row is then computed alone, so it is neither reused from
        the cache nor kept in it."""
        length = len(request.prompt)
        return length % 2 == 1 and self._past_window(length) and not self._past_window(length - 1)

    def _remember(
        self, request: Request | _Refill, count: int | None = None, *, tokens: list[int] | None = None
    ) -> None:
        """Keep the key/values of ``request``'s prompt (its first ``count`` tokens; the start
        of its row; or ``tokens``, which its row holds) in the cache, in its group (LongRoPE:
        a prompt past the window was computed with the long factors throughout, one within
        it with the short ones)."""
        tokens = request.prompt[:count] if tokens is None else tokens
        group = self._cache_group(request)
        if self._even_calls and self._odd_long_rope(request):
            tokens = tokens[:-1]
        row = request.row

        def copy_rows(count: int) -> Rows:
            return [(keys[row, :, :count].copy(), values[row, :, :count].copy()) for keys, values in self._cache]

        if self.prefix_cache.store(tokens, copy_rows, group) is not None and row == 0:
            self._row0_tokens = (group, np.asarray(tokens, dtype=np.int64))

    def _bind(
        self,
        rows: slice,
        input_ids: npt.NDArray[Any],
        mask: npt.NDArray[Any],
        positions: Any,
        adapter: str | None,
        session: Any = None,
        *,
        every_position: bool = False,
    ) -> Any:
        """Run the decoder (``session``, else the folder's graph) on the cache rows ``rows``
        through ``adapter`` (``None``: the base model) and return the logits: of the last
        position, or (``every_position``, one row) of each position of ``input_ids``.

        The cache, logits and adapter bindings of a row range are made once and reused while
        the range (and adapter) stays the same (a decode step of an unchanged batch, the
        chunks of one prefill): only the inputs change from call to call. Building them anew
        took 48 OrtValues and 100 bind calls a step for a 24-layer model.
        """
        graph = self._graph
        session = session or graph.session
        fixed_logits = self._logits is not None and not every_position
        key = (rows.start, rows.stop, adapter, id(session), fixed_logits)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self._new_binding(rows, adapter, session, fixed_logits)
        binding.bind_cpu_input(graph.input_ids, input_ids)
        binding.bind_cpu_input(graph.attention_mask, mask)
        if graph.has_position_ids:
            binding.bind_cpu_input(graph.position_ids, positions)
        if graph.last_only:
            chosen = np.arange(input_ids.shape[1], dtype=np.int64) if every_position else LAST_POSITION
            binding.bind_cpu_input(LOGIT_POSITIONS, chosen)
        if not fixed_logits:
            binding.bind_output(graph.logits)  # their shape varies
        # After a long prompt's chunk, hand the arena's large buffers back (onnxruntime keeps
        # what the largest call needed otherwise: measured +220 MB after a 4,096-token prompt).
        shrink = self._shrink_arena if input_ids.shape[1] >= _SHRINK_AFTER_TOKENS else None
        session.run_with_iobinding(binding, shrink)
        if shrink is not None:
            release_freed_memory()  # what the arena gave back stays in the C heap otherwise
        self.steps += 1
        if fixed_logits and self._logits is not None:
            # Views into the engine's buffer: each caller samples from them before the
            # next call over the same rows overwrites them.
            return self._logits[rows]
        logits: npt.NDArray[np.float32] = binding.get_outputs()[-1].numpy()
        return logits

    def _new_binding(self, rows: slice, adapter: str | None, session: Any, fixed_logits: bool) -> Any:
        graph = self._graph
        if len(self._bindings) >= 2 * self.max_batch_size:
            self._bindings.clear()  # ranges churn as requests come and go; keep the map small
        binding = session.io_binding()
        graph.bind_cache(binding, self._cache, rows)
        # An unbound LoRA input takes its default (the base model): a binding keeps the
        # adapter it was made with, so bindings are kept per adapter too.
        for name, tensor in self._adapter_inputs[adapter].items() if adapter is not None else ():
            binding.bind_ortvalue_input(name, tensor)
        if fixed_logits:
            assert self._logits is not None
            binding.bind_ortvalue_output(graph.logits, ort.OrtValue.ortvalue_from_numpy(self._logits[rows]))
        return binding

    def _prefill_chunk(self, request: Request | _Refill, chunk: int | None = None) -> npt.NDArray[np.float32] | None:
        """Cache the next chunk (``chunk`` tokens, else ``prefill_chunk_tokens``) of the
        prompt; the last chunk returns the logits.

        A LongRoPE prompt past the window goes in one call, as og prefills it (after a
        prefix-cache hit, all the rest in one): chunks ending within the window would be
        computed with the short factors, og's with the long ones.
        """
        graph = self._graph
        start = request.prefilled
        chunk = chunk or self.prefill_chunk
        scoring = isinstance(request, Request) and request.prompt_scores is not None
        if scoring and graph.vocab_size:  # every position's logits come back: within _SCORED_LOGITS_BYTES
            chunk = min(chunk, max(2, _SCORED_LOGITS_BYTES // (4 * graph.vocab_size)))
        end = min(len(request.prompt), start + chunk)
        long_rope = self._past_window(len(request.prompt))
        if long_rope:
            end = len(request.prompt)
        if self._even_calls:
            even_start, even_end = _even_call(start, end, len(request.prompt))
            if not long_rope or self._past_window(even_end):  # a first call stays past the window
                start, end = even_start, even_end
        ids = np.asarray([request.prompt[start:end]], dtype=graph.ids_dtype)
        # The mask spans everything cached so far: GQA appends the chunk after it.
        mask = np.ones((1, end), dtype=graph.mask_dtype)
        positions = np.arange(start, end, dtype=graph.ids_dtype)[None, :]
        # A prompt to score goes through the model itself: int8 activations would move its logprobs.
        session = self.prefill_session if end - start >= _INT8_PREFILL_MIN_TOKENS and not scoring else None
        rows = slice(request.row, request.row + 1)
        logits = self._bind(rows, ids, mask, positions, request.adapter, session, every_position=scoring)
        if scoring:
            assert isinstance(request, Request)
            request.score_prompt(start, logits[0])
        request.prefilled = end
        return logits[0, -1] if end == len(request.prompt) else None

    def _decode_step(self) -> None:
        if len(self._rows) == 1 and not self._inbox and self._prefilling is None:
            request = self._rows[0]
            if request.drafter is not None and self._speculate(request):
                return
        if self._graph.rope_window is not None or self._adapter_inputs:
            self._regroup()
        rows = list(self._rows)
        # The batch's mask is as wide as its longest row, and a LongRoPE graph picks its
        # factors from that width: rows within the window and rows past it (og decodes each
        # with its own length) go in separate calls, one per run of neighbouring rows
        # (one run per side after _regroup); so do rows of different adapters.
        logits: list[npt.NDArray[np.float32]] = []
        start = 0
        for end in range(1, len(rows) + 1):
            if end == len(rows) or self._call_group(rows[end]) != self._call_group(rows[start]):
                logits.extend(self._decode_rows(rows[start:end], start))
                start = end
        # Only now: a request finishing here frees its row and moves another into it.
        for request, row_logits in zip(rows, logits, strict=True):
            if not request.cancelled:
                self._accept(request, row_logits)

    def _decode_rows(self, rows: list[Request], first: int) -> npt.NDArray[np.float32]:
        """The next-token logits of ``rows``, which sit at batch rows ``first`` onwards."""
        graph = self._graph
        lengths = np.fromiter((r.length for r in rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter((r.tokens[-1] for r in rows), dtype=graph.ids_dtype, count=len(rows))[:, None]
        # Each row's new token sits right after its own cached tokens (right-aligned cache).
        width = int(lengths.max())
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(graph.mask_dtype)
        positions = (lengths - 1).astype(graph.ids_dtype)[:, None]
        count = len(rows)
        dummy = self._dummy_length(first + 1) if count == 1 and self._pad_lone_row else None
        if dummy is not None:
            # A lone row goes with a dummy in the row after it: onnxruntime's int4 MatMul
            # multiplies one row by another kernel than several, which rounds differently
            # (see _lone_row_rounds_differently).
            width = max(width, dummy)
            lengths = np.asarray([lengths[0], dummy])
            ids = np.concatenate([ids, ids])
            mask = (np.arange(width)[None, :] < lengths[:, None]).astype(graph.mask_dtype)
            positions = (lengths - 1).astype(graph.ids_dtype)[:, None]
            count = 2
        rows_slice = slice(first, first + count)
        logits: npt.NDArray[np.float32] = self._bind(rows_slice, ids, mask, positions, rows[0].adapter)[: len(rows), -1]
        return logits

    def _dummy_length(self, row: int) -> int | None:
        """The length a dummy in cache row ``row`` may have without changing anything read
        later: 1 in a free row; in the row whose prompt is going in, one past what is in,
        which the prompt's next chunk writes again. ``None``: no such row."""
        if row >= self.max_batch_size:
            return None
        pending = self._prefilling
        if pending is not None and pending.row == row:
            return int(pending.prefilled) + 1
        return 1 if row >= len(self._rows) + (pending is not None) else None

    def _speculate(self, request: Request) -> bool:
        """Check a draft of ``request``'s next tokens in one call, if one is worth it, and
        take what it confirms; ``False``: no draft was worth a call (decode as usual).

        Only while the request runs alone: onnxruntime's GroupQueryAttention takes several
        new tokens only in a batch of one (``batch_size must be 1 when sequence_length > 1``),
        so a request checking a draft beside others is a call of its own besides the batch's
        step, costing more than the batched step saves (measured on SmolLM2-135M int4: a
        step of 8 rows 20.8 ms, a 5-position call of one request 13.0 ms).

        The call's positions are sampled in order exactly as decode steps would sample
        them (grammar, penalties, stop strings, seeds), each from logits given the draft
        before it; the first token that differs from the draft ends the run in its place.
        Its rows are computed as a prompt's are, which round differently from a one-token
        step's: greedy tokens agree but for near-ties (see docs/performance.md).
        """
        drafter = request.drafter
        assert drafter is not None
        graph = self._graph
        length = request.length
        limit = min(MAX_DRAFT_TOKENS, request.max_tokens - len(request.tokens) - 1)
        window = graph.rope_window
        if window is not None and length <= window:
            limit = min(limit, window - length)  # the whole call within LongRoPE's window, as a step's
        draft = drafter.propose(request.tokens, limit)
        size = draft_length(drafter.acceptance, len(draft))
        if not draft and self._draft is not None:  # no prediction to follow: the draft model's
            size = draft_length(drafter.acceptance, limit, self._draft.cost)
            draft = self._draft.propose(request, size) if size else []
        if size == 0:
            if draft or self._draft is not None:
                drafter.skipped()
            return False
        draft = draft[:size]
        ids = np.asarray([[request.tokens[-1], *draft]], dtype=graph.ids_dtype)
        mask = np.ones((1, length + size), dtype=graph.mask_dtype)
        positions = np.arange(length - 1, length + size, dtype=graph.ids_dtype)[None, :]
        rows = slice(request.row, request.row + 1)
        logits = self._bind(rows, ids, mask, positions, request.adapter, every_position=True)
        events = []
        for position in range(size + 1):
            events.append(request.advance(logits[0, position]))
            if events[-1].finish_reason is not None or position == size or request.tokens[-1] != draft[position]:
                break
        accepted = sum(
            1 for token, drafted in zip(request.tokens[-len(events) :], draft, strict=False) if token == drafted
        )
        drafter.record(size, accepted)
        self.draft_tokens += size
        self.accepted_draft_tokens += accepted
        if events[-1].finish_reason is not None:
            self._release(request)
            # Its usage counts this call's drafts, accounted only now.
            events[-1] = dataclasses.replace(events[-1], usage=request.usage())
        for event in events:
            request.deliver(event)
        return True

    def _accept(self, request: Request, logits: npt.NDArray[np.float32]) -> None:
        """Sample the next token of ``request`` and tell its consumer."""
        event = request.advance(logits)
        if event.finish_reason is None:
            request.deliver(event)
        else:
            self._deliver_then_release(request, event)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._deliver_then_release(request, request.final(reason))

    def _deliver_then_release(self, request: Request, event: Any) -> None:
        """Tell the consumer a request's last event, then free its row: the release copies
        its key/values into the prefix cache (milliseconds), which the reader need not wait
        for; this thread does it before any other work reads the row."""
        self._releasing += 1  # ``refilling`` says so until the release has queued its refill
        try:
            request.deliver(event)
            self._release(request)
        finally:
            self._releasing -= 1

    def _release(self, request: Request, *, keep: bool = True) -> None:
        """Free the request's row (``keep``: its key/values go to the prefix cache first);
        the last row moves into the hole so rows stay dense."""
        row = request.row
        if row < 0:
            return
        if keep:
            history = request.prompt + request.tokens
            whole = request.tokens and not request.cancelled and self._graph.rope_window is None
            if whole and self._keep_decoded:
                # The reply's rows as decode steps wrote them: all but the last token's,
                # which no step has fed yet.
                self._remember(request, tokens=history[: request.length - 1])
            else:
                # Only the prompt's rows (the reply's were written by decode steps, see
                # _prefix_cache): its prefill stored them already; this marks them recently used.
                self._remember(request)
                if whole and len(history) <= self.prefix_cache.budget_tokens:
                    self._refills.append(_Refill(history, request.adapter, request.options.cache_salt))
        last = self._rows.pop()
        if last is not request:
            self._copy_row(last.row, row, last.length)
            self._rows[row] = last
            last.row = row
        request.row = -1
        pending = self._prefilling
        if pending is not None and pending.row != len(self._rows):
            # The prompt being prefilled sits right after the running rows: follow them down.
            self._copy_row(pending.row, len(self._rows), pending.prefilled)
            pending.row = len(self._rows)
        if last is not request:
            # The hole now holds ``last``: what the finished request wrote past that is stale.
            self._give_back_tokens(row, last.length, request.length)
        self._give_back_rows(len(self._rows) + (pending is not None))

    def _give_back_rows(self, first: int) -> None:
        """Return the memory of the rows from ``first`` on (no request holds them) to the
        operating system: a burst of requests leaves nothing behind once they are done."""
        if self.prefix_cache.budget_tokens > 0:
            # Row 0 stays resident: a lone stream's next turn copies its history from the
            # prefix cache into it, and fresh pages cost more than the copy (a 600-token
            # history of SmolLM2: 15 ms of page faults against 3 ms of copying, measured).
            first = max(first, 1)
        if first == 0:
            self._row0_tokens = None
        if first >= self._rows_touched:
            return
        for arrays in self._cache:
            for array in arrays:
                row_bytes = array[0].nbytes
                give_back(array, first * row_bytes, self._rows_touched * row_bytes)
        self._rows_touched = first

    def _give_back_tokens(self, row: int, start: int, end: int) -> None:
        """Return the memory of the tokens ``start`` to ``end`` of cache row ``row``."""
        if row == 0:
            self._row0_tokens = None
        for arrays in self._cache:
            for array in arrays:
                heads, length, head_size = array.shape[1:]
                token_bytes = head_size * array.itemsize
                for head in range(heads):
                    base = (row * heads + head) * length * token_bytes
                    give_back(array, base + start * token_bytes, base + min(end, length) * token_bytes)

    def _regroup(self) -> None:
        """Order the rows by :meth:`_call_group` (LongRoPE's side of the window, then the
        adapter), so that a decode step makes one call per group rather than one per run.

        Rows arrive at the end, leave by the last row moving into the hole, and cross the
        window as they decode; each misplaced row is swapped into place once (copying both
        rows, a one-off cost against an extra call per step for the rest of both requests).
        """
        rows = self._rows
        for target, request in enumerate(sorted(rows, key=self._call_group)):
            if rows[target] is not request:
                self._swap_rows(target, request.row)

    def _swap_rows(self, first: int, second: int) -> None:
        if 0 in (first, second):
            self._row0_tokens = None
        rows = self._rows
        one, other = rows[first], rows[second]
        for keys, values in self._cache:
            for cache in (keys, values):
                held = cache[first, :, : one.length].copy()
                cache[first, :, : other.length] = cache[second, :, : other.length]
                cache[second, :, : one.length] = held
        rows[first], rows[second] = other, one
        other.row, one.row = first, second

    def _copy_row(self, source: int, target: int, length: int) -> None:
        if target == 0:
            self._row0_tokens = None
        for keys, values in self._cache:
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]


_BACKGROUND_CHUNK = 32
"""Prompt tokens a background request prefills per call: an interactive request arriving
meanwhile waits for one such call, not a whole prompt."""


@dataclasses.dataclass(eq=False)
class _Refill:
    """A finished request's prompt and reply, prefilled for the prefix cache while the
    engine is idle (see :meth:`OrtCpuEngine._refill_step`); what the prefill path reads
    of a :class:`Request`."""

    prompt: list[int]
    adapter: str | None
    cache_salt: str | None = None
    row: int = -1
    prefilled: int = 0
    cached_tokens: int = 0


_REFILLS = 8
"""Finished requests waiting for a refill; older ones are dropped."""
_REFILL_CHUNK = 32
"""Tokens per refill call: what a request arriving during a refill may wait for (about
0.1 s on the 0.5B-shaped model)."""


def _even_call(start: int, end: int, length: int) -> tuple[int, int]:
    """The prompt positions a prefill call computes for the chunk ``start:end`` of a
    ``length``-token prompt: the chunk itself, or one token more, so that the call has an
    even number of rows (a one-token prompt aside).

    Why: onnxruntime's GroupQueryAttention takes the query rows of a call in blocks (32 rows
    on the tiny fixtures, 256 on SmolLM2-135M, measured with onnxruntime 1.31), and a block of
    one row goes through its one-row path, whose sums round differently. A row's key/values
    and logits then depend on where the call boundaries fell: a prompt's last token came
    out differently cold (in a 476-row call) and after a full prefix-cache hit (recomputed
    alone). Every other row is computed the same whatever call it is in (measured: every
    split, chunk size and suffix length), so calls of an even number of rows (no block of
    one, blocks being of an even size) make a prompt's rows a function of its tokens alone.
    A chunk after the first starts one token early, recomputing a row the cache already
    holds (the same values again); a first chunk takes one token more, or, when it is the
    whole prompt, one less (the next call then recomputes it with its neighbour).
    """
    if (end - start) % 2 == 0 or length < 2:
        return start, end
    if start > 0:
        return start - 1, end
    return start, end + 1 if end < length else end - 1


def _adapter_inputs(adapters: Mapping[str, Path]) -> dict[str, dict[str, ort.OrtValue]]:
    """Per adapter name, its tensors by the decoder input they feed (read once, with
    onnxruntime's ``AdapterFormat``; the values keep the file's memory alive).

    Bound as inputs rather than activated in ``RunOptions.add_active_adapter``: onnxruntime
    ignores active adapters in ``run_with_iobinding`` (it warns so), and the cache needs
    the binding. An input left unbound takes its default, which gives the base model.
    """
    return {name: dict(ort.AdapterFormat.read_adapter(str(path)).get_parameters()) for name, path in adapters.items()}


_SCORED_LOGITS_BYTES = 64 * 2**20
"""The most logits one prefill call of a prompt to score hands back (every position's: a
chunk of 110 tokens for a 151,936-token vocabulary)."""
_INT8_PREFILL_MIN_TOKENS = 64
"""Prompt chunks this long or longer go through the int8 prefill session when there is one."""
_SHRINK_AFTER_TOKENS = 128
"""Calls of a prompt chunk this long or longer return the memory they took from the arena
(decode steps, one token a row, keep theirs however many rows they have)."""


@functools.cache
def _lone_row_rounds_differently() -> bool:
    """Whether onnxruntime's int4 MatMul (``MatMulNBits``) gives a row alone other bits than
    the same row among several. On an AVX2-only EPYC it does (another kernel for one row:
    SmolLM2-135M's logprobs moved up to 1.39 beside 7 other requests against alone); with
    AVX-512 it did not. Measured once per process on a small product."""
    rng = np.random.default_rng(0)
    k, n, block = 64, 32, 32
    packed = rng.integers(0, 256, size=(n, k // block, block // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(n * (k // block),)).astype(np.float32)
    node = onnx.helper.make_node(
        "MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block
    )
    graph = onnx.helper.make_graph(
        [node],
        "probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["M", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["M", n])],
        [onnx.numpy_helper.from_array(packed, "w"), onnx.numpy_helper.from_array(scales, "s")],
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((4, k)).astype(np.float32)
    return not np.array_equal(session.run(None, {"x": x[:1]})[0][0], session.run(None, {"x": x})[0][0])
