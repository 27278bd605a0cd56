"""``og-engine``: onnxruntime-genai's own ``og.Engine``, which batches and samples itself.

With paged attention (a folder built with ``use_paged_attention`` on CUDA or WebGPU) it
batches dynamically: requests join and leave at any step, and og applies per-turn seeds.
Otherwise (the CPU provider) its batches are static: at most 4 requests run together (og's
own limit; its ``engine.static_batching.max_batch_size`` does not raise it, measured) and a
newcomer waits for the whole batch; og refuses per-turn seeds there, so the front refuses
``seed`` with a 400 rather than ignore it. Since a static batch starts with whatever og
holds at the first ``Engine.run``, an idle engine gathers arrivals briefly before it runs
(until ``_GATHER_QUIET_S`` pass without a new one, ``_GATHER_MAX_S`` at most, or a batch is
full): requests sent together (asyncio.gather, concurrent HTTP calls) then share the first
batch instead of the first arrival running alone while the rest wait for it.

og samples (temperature, top-k/p, repetition penalty, min tokens, length) and applies
grammars (its llguidance) itself; tokens come back as events. Detokenization, stop
strings (a matched stop cancels the og turn) and usage are the front's, the same on
every engine. Every og call happens on the owner thread, as og requires.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og

from .._config import ModelConfig
from .._contract import EngineCapabilities, GenerationEvent, OwnerThread, Request
from .._errors import EngineError, InvalidRequestError, ModelLoadError

__all__ = ["OgEngine"]

_EVENTS = 256
"""Capacity of the event buffer one ``Engine.run`` fills."""
_GATHER_QUIET_S = 0.003
"""An idle static engine starts its batch once no request has arrived for this long..."""
_GATHER_MAX_S = 0.03
"""...or this long after it woke, whichever comes first (see the module docstring)."""
_LENGTH = frozenset({og.FinishReason.MAX_GENERATED_TOKENS, og.FinishReason.MAX_SESSION_TOKENS})


class _Turn:
    """One request's og side: the og.Request and its options, kept referenced until og is
    done with them (og holds on to them without a reference of its own)."""

    def __init__(self, og_request: Any, options: tuple[Any, ...], turn_id: int) -> None:
        self.og_request = og_request
        self.options = options
        self.turn_id = turn_id
        self.done = False
        """The front's request has had its final event (og may still send a few)."""
        self.started = False
        """og has scheduled it (a first token came back); before that it waits in og's queue."""


class OgEngine(OwnerThread):
    """``og.Engine`` over ``og_model`` (see the module docstring)."""

    name = "og-engine"

    def __init__(
        self,
        model_name: str,
        og_model: Any,
        config: ModelConfig,
        *,
        folder: Path,
        dynamic: bool,
        shortest_sequence: int = 0,
    ) -> None:
        if config.reproducible and dynamic:
            # og schedules a paged-attention folder's requests into shared batches as they
            # come: a request's rounding depends on its neighbours (refused, not left unkept).
            raise ModelLoadError(
                f"{folder}: reproducible cannot be kept on og-engine's dynamic batches (a paged-attention "
                "folder); turn it off for this model, or use engine og-generator",
                path=folder,
            )
        super().__init__(model_name)
        self._shortest = shortest_sequence
        """og's least session length for this folder (see GenaiFolder.shortest_sequence)."""
        self.provider: str = config.provider
        self.capabilities = EngineCapabilities(
            host_sampling=False,
            seeds=dynamic,
            media=False,
            batching="dynamic" if dynamic else "static",
            reproducible=not dynamic,
            salted_cache=not dynamic,
        )
        self._model = og_model
        self._turns: dict[Request, _Turn] = {}
        self._by_og: dict[int, Request] = {}
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.batch_size = 0
        self._start_thread()
        self._ready.wait()
        if self._load_error is not None:
            raise ModelLoadError(f"og.Engine could not start for {folder}: {self._load_error}", path=folder)

    @property
    def active(self) -> int:
        return sum(1 for turn in list(self._turns.values()) if turn.started and not turn.done)

    @property
    def queued(self) -> int:
        """Requests not yet scheduled: in the inbox, or begun in og but waiting for a batch."""
        return len(self._inbox) + sum(1 for turn in list(self._turns.values()) if not turn.started and not turn.done)

    # -- owner thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine, buffer = self._start_engine()
        except Exception as exc:  # noqa: BLE001  # reported to the constructor
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            with self._cond:
                while not (self._inbox or self._closing or self._cancels or engine.has_pending_requests()):
                    self._cond.wait()
                if self._inbox and self.capabilities.batching != "dynamic" and not engine.has_pending_requests():
                    self._gather()
                if self._closing:
                    break
                cancels, self._cancels = self._cancels, set()
                admitted = list(self._inbox)
                self._inbox.clear()
            for request in cancels:
                self._cancel(request)
            for request in admitted:
                if request.cancelled:
                    request.deliver(request.final("cancelled"))
                else:
                    self._begin(engine, request)
            if not engine.has_pending_requests():
                continue
            try:
                events = engine.run(buffer)
            except Exception as exc:  # noqa: BLE001  # an onnxruntime failure: fail what og holds
                for request in list(self._turns):
                    self._end(request, EngineError(f"generation failed: {exc}"))
                continue
            for event in events:
                self._event(event)
        error = self._closed_error()
        for request in [*self._inbox, *(r for r, t in self._turns.items() if not t.done)]:
            request.deliver(error)
        for turn in self._turns.values():
            turn.og_request.close()
        self._inbox.clear()
        self._turns.clear()

    def _start_engine(self) -> tuple[Any, Any]:
        """og.Engine over the model and its event buffer; a paged folder checked by a probe."""
        engine = og.Engine(self._model)
        self.batch_size = int(engine.get_capabilities().configured_max_batch_size)
        buffer = engine.create_event_buffer(_EVENTS)
        if self.capabilities.batching == "dynamic":
            self._probe(engine, buffer)
        return engine, buffer

    def _probe(self, engine: Any, buffer: Any) -> None:
        """Run a 3-token prompt for 2 tokens through og.Engine, or raise og's error: the load
        check of a paged-attention folder, which og.Generator cannot drive (its input_ids are
        one packed axis), so check_og_runs does not apply."""
        request_options = og.RequestOptions()
        request_options.set_max_session_tokens(max(5, self._shortest))
        og_request = engine.create_request(options=request_options)
        turn = og.TurnOptions(og_request)
        turn.set_max_generated_tokens(2)
        turn.set_do_sample(False)
        try:
            og_request.begin_turn(np.asarray([0, 1, 2], dtype=np.int32), turn)
            for _ in range(64):  # a few steps are enough; never spin on an engine that keeps it pending
                if not engine.has_pending_requests():
                    return
                for event in engine.run(buffer):
                    if int(event.flags) & int(og.EngineEventFlags.FAILED):
                        raise RuntimeError(f"og.Engine reported {event.error_code} on a 3-token prompt")
            raise RuntimeError("og.Engine did not finish a 3-token prompt in 64 steps")
        finally:
            og_request.close()

    def _gather(self) -> None:
        """With the lock held and og idle: wait while requests keep arriving (static batches)."""
        deadline = time.monotonic() + _GATHER_MAX_S
        while len(self._inbox) < max(self.batch_size, 1) and not self._closing:
            remaining = deadline - time.monotonic()
            seen = len(self._inbox)
            if remaining <= 0 or (not self._cond.wait(min(_GATHER_QUIET_S, remaining)) and len(self._inbox) == seen):
                return

    def _begin(self, engine: Any, request: Request) -> None:
        request.admit()  # its prefill time then includes og's own scheduling
        options = request.options
        try:
            request_options = og.RequestOptions()
            request_options.set_max_session_tokens(max(len(request.prompt) + request.max_tokens, self._shortest))
            og_request = engine.create_request(options=request_options)
            turn = og.TurnOptions(og_request)
            turn.set_max_generated_tokens(request.max_tokens)
            if options.min_tokens:
                turn.set_min_generated_tokens(options.min_tokens)
            if options.greedy:
                turn.set_do_sample(False)
            else:
                turn.set_do_sample(True)
                turn.set_temperature(options.temperature)
                turn.set_top_k(options.top_k)
                turn.set_top_p(options.top_p)
            if options.repetition_penalty != 1.0:
                turn.set_repetition_penalty(options.repetition_penalty)
            if options.seed is not None and self.capabilities.seeds:
                turn.set_seed(options.seed)
            if options.grammar is not None:
                turn.set_guidance(*options.grammar.og_guidance())
            turn_id = og_request.begin_turn(np.asarray(request.prompt, dtype=np.int32), turn)
        except RuntimeError as exc:  # og refuses what it cannot run (a turn option, a too-long prompt)
            request.deliver(InvalidRequestError(f"onnxruntime-genai refused the request: {exc}"))
            return
        self._turns[request] = _Turn(og_request, (request_options, turn), turn_id)
        self._by_og[id(og_request)] = request

    def _event(self, event: Any) -> None:
        request = self._by_og.get(id(event.request))
        if request is None:
            return
        turn = self._turns[request]
        flags = int(event.flags)
        if flags & int(og.EngineEventFlags.FAILED):
            self._end(request, EngineError(f"generation failed: og.Engine reported {event.error_code}"))
            return
        finished = bool(flags & int(og.EngineEventFlags.TURN_FINISHED))
        if finished and event.usage is not None:
            # og's own prefix reuse (paged attention); 0 on the CPU's static batches.
            request.cached_tokens = int(event.usage.cached_prompt_tokens)
        turn.started = True
        if not turn.done and flags & int(og.EngineEventFlags.TOKEN):
            result = request.take(int(event.token))
            if result.finish_reason is not None:
                turn.done = True
                if not finished:
                    turn.og_request.cancel_turn(turn.turn_id)  # a stop string or the grammar's end
            request.deliver(result)
        if finished:
            if not turn.done and event.finish_reason == og.FinishReason.EOS and request.eos:
                # og ends on EOS without a token event; the front counts EOS as generated
                # (as og.Generator and ort-cpu do) and streams no text for it.
                request.deliver(request.take(min(request.eos)))
            elif not turn.done:  # a length limit, or the grammar's end
                request.deliver(request.final("length" if event.finish_reason in _LENGTH else "stop"))
            self._drop(request)

    def _cancel(self, request: Request) -> None:
        turn = self._turns.get(request)
        if turn is None:
            if request in self._inbox:
                self._inbox.remove(request)
            request.deliver(request.final("cancelled"))
            return
        if not turn.done:
            turn.done = True
            turn.og_request.cancel_turn(turn.turn_id)
            request.deliver(request.final("cancelled"))

    def _end(self, request: Request, error: BaseException | GenerationEvent) -> None:
        turn = self._turns.get(request)
        if turn is not None and not turn.done:
            turn.done = True
            request.deliver(error)
        self._drop(request)

    def _drop(self, request: Request) -> None:
        turn = self._turns.pop(request, None)
        if turn is not None:
            self._by_og.pop(id(turn.og_request), None)
            turn.og_request.close()
