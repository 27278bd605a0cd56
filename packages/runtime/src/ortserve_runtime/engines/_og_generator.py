"""``og-generator``: one ``og.Generator`` per request, stepped in turn, on any provider.

Multimodal models do not run on ``og.Engine`` ("Expected a decoder-only model") nor on
``ort-cpu`` (their decoder takes embeddings the vision and speech graphs produce), and
some providers cannot batch with ``og.Engine``; so each request gets its own generator:

* one owner thread runs up to ``concurrency`` generators, one token each in turn, so
  concurrent streams all advance; a new request's prompt (thousands of tokens with an
  image) goes in on a second thread meanwhile, so it does not stall them; more requests
  wait in the inbox, and a cancelled one leaves it at once or stops at its next token,
  freeing its cache;
* the logits come back to the host, so sampling, grammars, seeds and stop strings are the
  same as on ``ort-cpu``;
* a request's LoRA adapter (loaded with the model into ``og.Adapters``) is set on its own
  generator, so requests of different adapters run side by side.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnxruntime_genai as og

from .._config import ModelConfig
from .._errors import EngineError, ModelLoadError
from .._threads import OwnerThread
from ..chat._request import Request
from ._base import EngineCapabilities

__all__ = ["OgGeneratorEngine"]


class OgGeneratorEngine(OwnerThread):
    """An ``og.Generator`` per request on ``og_model``'s provider, interleaved token by token."""

    name = "og-generator"
    capabilities = EngineCapabilities(
        host_sampling=True, seeds=True, media=True, batching="interleaved", reproducible=True
    )

    def __init__(
        self,
        model_name: str,
        og_model: Any,
        config: ModelConfig,
        *,
        concurrency: int,
        shortest_sequence: int = 0,
        adapters: Mapping[str, Path] | None = None,
    ) -> None:
        super().__init__(model_name)
        self._shortest = shortest_sequence
        """og's least max_length for this folder (see GenaiFolder.shortest_sequence); the
        request still stops at its own max_tokens."""
        self.provider: str = config.provider
        self._model = og_model
        self._adapters: Any = None
        if adapters:
            self._adapters = og.Adapters(og_model)
            for name, path in adapters.items():
                try:
                    self._adapters.load(str(path), name)
                except RuntimeError as exc:
                    raise ModelLoadError(
                        f"adapter {name!r}: onnxruntime-genai cannot load {path}: {exc}", path=path
                    ) from exc
        self._adapter_changes: list[tuple[str, Path | None, concurrent.futures.Future[None]]] = []
        """Adapters to load (a path) or retire (``None``), applied by the owner thread between steps."""
        self._retired: set[str] = set()
        """Adapters to unload from og once no generator uses them."""
        self.concurrency = concurrency
        self._running: dict[Request, Any] = {}
        """Requests being generated, each with its og.Generator."""
        self._starting: dict[Request, concurrent.futures.Future[Any]] = {}
        """Requests whose prompt goes in on the prefill thread (an image prompt takes long;
        the running streams keep stepping meanwhile: og generators run side by side)."""
        self._start_thread()

    @property
    def active(self) -> int:
        return len(self._running) + len(self._starting)

    def _run(self) -> None:
        prefill = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ortserve-prefill-{self.model_name}")
        starting = self._starting
        while True:
            with self._cond:
                while not (
                    self._inbox
                    or self._running
                    or self._closing
                    or self._cancels
                    or any(f.done() for f in starting.values())
                    or (self._adapter_changes and all(f.done() for f in starting.values()))
                ):
                    self._cond.wait()
                if self._closing:
                    break
                # og.Adapters may not lock its table (onnxruntime-genai added a mutex only
                # later): it is changed only while no prompt is going in on the prefill
                # thread (which looks adapters up), and no new one starts meanwhile.
                idle = all(f.done() for f in starting.values())
                changes: list[tuple[str, Path | None, concurrent.futures.Future[None]]] = []
                if idle and self._adapter_changes:
                    changes, self._adapter_changes = self._adapter_changes, []
                in_use = {r.adapter for r in (*self._inbox, *self._running, *starting)}
                cancels, self._cancels = self._cancels, set()
                ended = [r for r in cancels if r in self._inbox or r in self._running]
                for request in ended:
                    if request in self._inbox:
                        self._inbox.remove(request)
                    self._running.pop(request, None)
                admit = bool(self._inbox) and not starting and not changes and len(self._running) < self.concurrency
                if admit:
                    admitted = self._inbox.popleft()
                    starting[admitted] = prefill.submit(self._prefill, admitted)
                    starting[admitted].add_done_callback(lambda _: self._wake())
                # Retired adapters are unloaded when the prefill thread stays idle this turn.
                adapting = bool(changes) or (idle and not admit and bool(self._retired))
            for request in ended:
                request.deliver(request.final("cancelled"))
            if adapting:
                self._change_adapters(changes, in_use)
            for request in [r for r, f in starting.items() if f.done()]:
                # popped into the call: no local name keeps the generator (and og's hold
                # on its adapter) alive after its request ends
                self._started(request, starting.pop(request))
            for request, generator in list(self._running.items()):
                self._guarded(request, self._step, request, generator)
        prefill.shutdown(wait=True)
        for _, _, done in self._adapter_changes:
            done.set_exception(self._closed_error())
        error = self._closed_error()
        for request in [*self._inbox, *self._running, *starting]:
            request.deliver(error)
        self._inbox.clear()
        self._running.clear()

    def add_adapter(self, key: str, path: Path) -> None:
        """Load LoRA adapter ``key`` into og (on the owner thread, between steps, while no
        prompt goes in); any thread but the owner's; raises what og raises for the file."""
        self._change_adapter(key, path).result()

    def retire_adapter(self, key: str) -> None:
        """Unload adapter ``key`` from og once no generator uses it; any thread."""
        self._change_adapter(key, None)

    def _change_adapter(self, key: str, path: Path | None) -> concurrent.futures.Future[None]:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                done.set_exception(self._closed_error())
                return done
            self._adapter_changes.append((key, path, done))
            self._cond.notify()
        return done

    def _change_adapters(
        self, changes: list[tuple[str, Path | None, concurrent.futures.Future[None]]], in_use: set[str | None]
    ) -> None:
        for key, path, done in changes:
            if path is None:
                self._retired.add(key)
                done.set_result(None)
                continue
            try:
                if self._adapters is None:
                    self._adapters = og.Adapters(self._model)
                self._adapters.load(str(path), key)
            except Exception as exc:  # noqa: BLE001  # og's error for the file, to the caller
                done.set_exception(exc)
            else:
                done.set_result(None)
        for key in self._retired - in_use:
            with contextlib.suppress(Exception):  # a generator still holds it: again after the next step
                self._adapters.unload(key)
                self._retired.discard(key)

    def _guarded(self, request: Request, action: Any, *args: Any) -> None:
        """Run one request's step; an onnxruntime failure fails that request only."""
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001
            self._running.pop(request, None)
            request.deliver(EngineError(f"generation failed: {exc}"))

    def _prefill(self, request: Request) -> Any:
        """On the prefill thread: a generator with the prompt in its cache."""
        params = og.GeneratorParams(self._model)
        params.set_search_options(max_length=max(len(request.prompt) + request.max_tokens, self._shortest))
        generator = og.Generator(self._model, params)
        if request.adapter is not None:
            generator.set_active_adapter(self._adapters, request.adapter)
        if request.media is not None:
            generator.set_inputs(request.media)
        else:
            generator.append_tokens(request.prompt)
        return generator

    def _started(self, request: Request, future: concurrent.futures.Future[Any]) -> None:
        if request.cancelled:
            request.deliver(request.final("cancelled"))
            return
        error = future.exception()
        if error is not None:
            request.deliver(EngineError(f"generation failed: {error}"))
            return
        self._running[request] = future.result()
        self._guarded(request, self._accept, request, self._running[request])

    def _step(self, request: Request, generator: Any) -> None:
        generator.append_tokens([request.tokens[-1]])
        self._accept(request, generator)

    def _accept(self, request: Request, generator: Any) -> None:
        event = request.advance(generator.get_logits().reshape(-1))
        if event.finish_reason is not None:
            del self._running[request]
        request.deliver(event)
