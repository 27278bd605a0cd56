"""The runner of OpenAI's Batch API (its routes are ``api.batches``): works through the
lines of open batches and collects the answers as output and error files.

The lines of a batch run in this process, one batch at a time, through the same routes
(and so the same checks and answers) as interactive requests: each line is a request made
to a private app holding the API routes, as the batch's owner. They run behind interactive
requests (``GenerationOptions.background``): queued after them, and on ort-cpu a line gives
its batch row up when an interactive request waits with every row taken (it runs again
later; its prompt is still in the prefix cache). At most ``batch_concurrency`` lines run
at once, so that lines fill idle rows rather than the queue interactive requests wait in.

Everything a client was promised is in the state database (see ``_batch_store``): a
restart, even after SIGKILL, resumes open batches and runs exactly the lines that have no
answer yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from litestar import Litestar, Router
from litestar.di import Provide
from ortserve_client import batch_protocol as bp

from ._auth import CALLER, Caller, key_digest
from ._batch_store import OPEN, RUNNER, PendingLine
from ._errors import exception_handlers
from ._ids import new_id
from ._leases import release_leases
from ._observe import observe_requests
from ._state import OrtServe

__all__ = ["BatchRunner"]

logger = logging.getLogger("ortserve.server")

_RETRY_CODES = {"preempted", "model_unloaded", "model_crashed", "model_capacity", "overloaded", "server_overloaded"}
"""503 answers that say "send it again": a line that gets one runs again (a preempted one
any number of times, the others up to ``_RETRIES`` times)."""
_RETRIES = 20


class _ErrorCode(msgspec.Struct):
    code: str | None = None


class _Answered(msgspec.Struct):
    """The one field of a line's answer the runner reads (the rest is kept as bytes)."""

    error: _ErrorCode | None = None


_error_code = msgspec.json.Decoder(_Answered).decode
LEASE = 15.0
"""Seconds a runner holds a batch without renewing its claim; replicas sharing the state
database run each batch in one of them, and take over one whose runner went quiet."""

MAX_LINE_STARTS = 3
"""Starts of one line (its first, and after the server ended while running it) before it is
answered with an error instead: a crash or two mid-line (an OOM kill, a power cut) is no
reason to give it up; a line this process stops itself gives its start back. A line
started again runs alone (``BatchStore.pending_lines``), so a line refused is one the
server ended running at least twice with no other batch line beside it."""


# -- running ---------------------------------------------------------------------------------


class BatchRunner:
    """Runs the open batches, oldest first, in the event loop it is started from."""

    def __init__(self, state: OrtServe) -> None:
        self._state = state
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._cancelled: set[str] = set()
        self._app: Litestar | None = None
        self._app_lock = anyio.Lock()
        self._key_labels = {key_digest(key): label for key, label in state.config.api_key_labels.items()}
        """A batch's owner (its key's digest) to the key's label, which its lines' usage counts under."""

    def start(self) -> None:
        """Run open batches (no-op where running); from the event loop that serves."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ortserve-batches")
        self._wake_up()

    def cancel(self, batch_id: str) -> None:
        self._cancelled.add(batch_id)
        self._wake_up()

    async def stop(self) -> None:
        """Stop running lines (those without an answer run again at the next start)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            ran = False
            try:
                batches = await self._state.batches.open_batches()
                for batch, owner, scope, trace in batches:
                    if await self._state.batches.claim(batch.id, RUNNER, LEASE):
                        await self._batch(batch, owner, scope, trace)
                        ran = True
            except asyncio.CancelledError:
                raise
            except Exception:  # a database that failed us: try again in a while, keep serving
                logger.exception("running batches failed; trying again in 30 s")
                await asyncio.sleep(30)
                continue
            if not ran:  # none open, or all run elsewhere: look again when their lease may end
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), LEASE / 2 if batches else 60)

    async def _batch(self, batch: bp.Batch, owner: str, scope: str | None, trace: str | None) -> None:
        store = self._state.batches
        if batch.status == "validating":
            batch.status, batch.in_progress_at = "in_progress", int(time.time())
            if not await store.update_batch(batch, unless=("cancelling",)):
                batch.status = "cancelling"
        if batch.status == "in_progress" and not await self._lines(
            batch, Caller(owner=owner, cache_scope=scope, background=True, key=self._key_labels.get(owner, "")), trace
        ):
            return
        current = await store.batch(None, batch.id)
        if current is None or current.status not in OPEN:
            return
        now = int(time.time())
        if current.status == "cancelling" or batch.id in self._cancelled:
            await store.close_lines(batch.id, "batch_cancelled", "the batch was cancelled before this line ran")
            current.status, current.cancelled_at = "cancelled", now
        elif current.expires_at is not None and now >= current.expires_at:
            await store.close_lines(batch.id, "batch_expired", "the batch expired before this line ran")
            current.status, current.expired_at = "expired", now
        else:
            current.status, current.finalizing_at, current.completed_at = "completed", now, now
        self._cancelled.discard(batch.id)
        done = await store.finish(current, owner)
        logger.info("batch %s %s: %s", batch.id, done.status, done.request_counts)

    async def _lines(self, batch: bp.Batch, caller: Caller, trace: str | None) -> bool:
        """Run the batch's lines without an answer until none is left, or it is cancelled
        or expires (the lines running then stop, unanswered); ``False`` when another runner
        took the batch over, or a shutdown cut the work off."""
        store = self._state.batches
        limit = self._state.config.batch_concurrency
        running: dict[int, asyncio.Task[None]] = {}
        alone = taken_over = False
        claim: asyncio.Future[list[PendingLine]] | None = None
        claimed = time.monotonic()
        try:
            while batch.id not in self._cancelled and (batch.expires_at is None or time.time() < batch.expires_at):
                if self._state.cut_off:
                    # A shutdown whose grace period ran out: the lines it cut run again at the
                    # next start, and the batch is not finished here (twentieth probe, issue 45:
                    # their 503s were kept as answers and the batch completed).
                    return False
                if time.monotonic() - claimed > LEASE / 3:
                    if not await store.claim(batch.id, RUNNER, LEASE):
                        taken_over = True
                        return False  # taken over (this process was too slow to renew): its runner goes on
                    claimed = time.monotonic()
                    current = await store.batch(None, batch.id)
                    if current is None or current.status != "in_progress":
                        return True  # cancelled through another replica
                if len(running) < limit and not alone:
                    # Shielded: stopped while claiming, the lines it counted started are known (below).
                    claim = asyncio.ensure_future(store.pending_lines(batch.id, limit - len(running), set(running)))
                    for line in await asyncio.shield(claim):
                        running[line.line] = asyncio.create_task(self._line(batch, line, caller, trace))
                        # A suspect (see pending_lines): no other line runs beside it (nor one of another
                        # batch: a process runs one batch at a time).
                        alone = line.started > 1
                    claim = None
                if not running:
                    return True
                done, _ = await asyncio.wait(running.values(), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # a database failure: the batch waits for the next round
                running = {number: task for number, task in running.items() if not task.done()}
                alone = alone and bool(running)
            return True
        finally:
            stopped = list(running)
            if claim is not None:  # stopped while claiming lines: their starts were counted
                with contextlib.suppress(Exception):
                    stopped += [line.line for line in await claim]
            for task in running.values():
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
            if stopped and not taken_over:  # stopped here, not ended with the process (taken over: theirs now)
                with contextlib.suppress(Exception):
                    await store.unstart(batch.id, stopped)

    async def _line(self, batch: bp.Batch, line: PendingLine, caller: Caller, trace: str | None) -> None:
        if line.started > MAX_LINE_STARTS:
            # The server ended while running it that many times: a line that kills it (a
            # grammar past its compiler's stack did; sixteenth probe) stops each restart.
            logger.error(
                "batch %s line %d: not run again, the server ended %d times running it",
                batch.id,
                line.line,
                line.started - 1,
            )
            stopped = bp.LineError(
                code="line_not_resumed",
                message=f"the server ended {line.started - 1} times while running this line: it is not run again",
            )
            answer = bp.BatchOutputLine(id=new_id("batch_req_"), custom_id=line.custom_id, response=None, error=stopped)
            await self._state.batches.answer(batch.id, line.line, 0, answer)
            return
        attempt = 0
        request_id = new_id("req_")  # the line's answer, its log line and its span share it
        while True:
            status, body = await self._call(batch.endpoint, line.request, caller, request_id, trace)
            code = _retry_code(body) if status == 503 else None
            if code == "server_shutting_down":  # cut by the shutdown: not its answer, it runs again
                await self._state.batches.unstart(batch.id, [line.line])
                return
            if code not in _RETRY_CODES or (code != "preempted" and attempt >= _RETRIES):
                break
            attempt += code != "preempted"
            await asyncio.sleep(0.05 if code == "preempted" else min(0.5 * attempt, 5.0))
        answer = bp.BatchOutputLine(
            id=new_id("batch_req_"),
            custom_id=line.custom_id,
            response=bp.BatchResponse(status_code=status, request_id=request_id, body=body),
            error=None,
        )
        await self._state.batches.answer(batch.id, line.line, status, answer)

    async def _routes(self) -> Litestar:
        """The private app lines run through, made at the first line, on a worker thread:
        building its routes took 0.4 s, which on the event loop held every request (the probe
        of issue 45: /health 490 ms as a batch started)."""
        async with self._app_lock:
            if self._app is None:
                self._app = await anyio.to_thread.run_sync(_line_app, self._state)
        return self._app

    async def _call(
        self, url: str, body: bytes, caller: Caller, request_id: str, trace: str | None = None
    ) -> tuple[int, msgspec.Raw | str]:
        """POST ``body`` to ``url`` of the private app, as ``caller``: (status, its JSON
        answer as checked bytes, or the text of an answer that is not JSON). The answer is
        never made into Python objects: 200 lines of 200 KB (prompt logprobs) decoded on the
        loop made the heap grow fast enough for a full garbage collection every 0.65 s,
        each holding the loop 40-74 ms.
        ``request_id`` and ``trace`` (a ``traceparent``) go with it as their headers do."""
        app = await self._routes()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": url,
            "raw_path": url.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", request_id.encode()),
                *([(b"traceparent", trace.encode())] if trace else []),
            ],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
            "state": {},
            CALLER: caller,
        }
        sent = False
        status = 500
        chunks: list[bytes] = []
        # An Event, not a future every receive() awaits: the route's disconnect watch
        # (while_connected) is cancelled once the answer is ready, and cancelling a task that
        # awaits a future cancels the future, so the next receive() (a streamed answer's, which
        # large JSON answers are) raised CancelledError and the line was cancelled, run again,
        # and cancelled again without end.
        answered = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            # No disconnect while the line runs (it runs until it ends or is cancelled); once
            # its answer is whole, as a server says: a streamed answer waits for it to end.
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    answered.set()

        await app(scope, receive, send)  # type: ignore[arg-type]
        raw = b"".join(chunks)
        try:
            return status, msgspec.json.decode(raw, type=msgspec.Raw)  # checks it is JSON
        except msgspec.DecodeError:
            return status, raw.decode(errors="replace")


def _retry_code(body: msgspec.Raw | str) -> str | None:
    """The ``error.code`` of a 503 answer (``None`` when it has none)."""
    try:
        found = _error_code(body) if isinstance(body, msgspec.Raw) else None
    except msgspec.ValidationError:  # not an object, or fields of other types
        return None
    return found.error.code if found is not None and found.error is not None else None


def _line_app(state: OrtServe) -> Litestar:
    """The API routes batch lines run through: no guards (the batch's owner was checked when
    it was created, and the runner says who it is), the routes' own checks and errors."""
    from .api import api_route_handlers, responses_route_handlers

    router = Router(
        path="/v1",
        route_handlers=[*api_route_handlers, *responses_route_handlers],
        dependencies={"ortserve": Provide(lambda: state, sync_to_thread=False, use_cache=True)},
        exception_handlers=exception_handlers,
        middleware=[observe_requests(state.observer), release_leases],
        # A line is refused past max_body_size when it is uploaded: run, it was refused past
        # Litestar's own 10 MB (twenty-fifth probe, issue 45: a 12 MB line failed every time).
        request_max_body_size=state.config.max_body_size,
    )
    return Litestar(route_handlers=[router], openapi_config=None, exception_handlers=exception_handlers)
