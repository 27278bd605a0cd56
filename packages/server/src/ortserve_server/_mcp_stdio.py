"""The stdio transport of configured MCP servers: the server's process, newline-delimited
JSON-RPC on its stdin and stdout, with every message bounded.

The MCP SDK's own stdio client keeps no bound: a tool that printed 80 MB on one line
grew its buffer by concatenation, chunk after chunk, on the event loop (gaps of 589 ms),
and the connection answered nothing again. Here a line past ``max_bytes`` ends the
connection at once (the process is killed, the calls waiting on it fail saying why), a
large line is parsed on a worker thread, and :attr:`StdioLink.ended` tells the owner
that the connection is over (the process exited, or was stopped for its output: a line
too long, one that cannot be read, one with more keys or items than a request body may
have, a list of more than :data:`MAX_LISTED_TOOLS` tools, or
more than :data:`MAX_NOTIFICATIONS_PER_SECOND` notifications in a second), so the next use
starts the server again. The process itself is watched, not only its stdout: a server that
started a helper in a session of its own (outside the group that is stopped) and exited left
the pipe open, and every later call waited out the call timeout with no new server started.
Once the process has exited and its output is not over within :data:`_DRAIN` seconds, the
connection ends all the same. Notifications (log lines, progress) are counted and dropped here:
ortserve uses none a server sends, and the SDK handled each in a task of its own on the
event loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from ._json_bounds import json_past_bounds

__all__ = [
    "BLANK_BYTES_PER_MINUTE",
    "MAX_LISTED_TOOLS",
    "MAX_NOTIFICATIONS_PER_SECOND",
    "NESTED_TOO_DEEP",
    "STDERR_LINES_PER_MINUTE",
    "PerSecond",
    "StdioLink",
    "is_notification",
    "message_past_bounds",
]

logger = logging.getLogger("ortserve.mcp")

_PARSE_INLINE = 64 * 1024
"""Lines up to this are parsed on the event loop; longer ones on a worker thread."""
MAX_LISTED_TOOLS = 1000
"""Tools one message may list: 50,000 took 1.9 s to parse and 0.6 s more to read as tools,
holding the event loop (a request takes at most 128 tools anyway)."""
MAX_MESSAGE_KEYS = 16_384
"""Object keys (and objects and arrays) an MCP message may have in all: the SDK makes its
models on the event loop at some 2 µs a key (a tool list of 999 tools of 14 properties,
47,000 keys, held /health 106-200 ms; a result of 16,000 text blocks 210-380 ms, with their
``model_dump`` after), against 0.7 µs for a request body
(:data:`._json_bounds.MAX_JSON_KEYS`). 128 tools of 30 properties each fit, and a result is
cut to ``mcp_max_output_bytes`` (64 KiB) for the model anyway."""
MAX_MESSAGE_ITEMS = 100_000
"""Array items an MCP message may have in all (490,000 in a result's ``structuredContent``
held /health 100-113 ms)."""
MAX_NOTIFICATIONS_PER_SECOND = 1000
"""Notifications (progress, log lines) a server may send in a second: 200,000 from one call,
each handed to the SDK, held the event loop up to 0.5 s at a time until the call timed out
(dropped here, a thousand still cost 30-115 ms of the loop's time before they stopped)."""
NESTED_TOO_DEEP = "nested too deep to decode"
"""What a message nested past the depth Python's ``json`` decodes is said to be."""
STDERR_LINES_PER_MINUTE = 120
"""Lines of a server's stderr logged a minute (each cut at :data:`STDERR_LINE_CHARS`); the
rest are counted, and the count logged. Passed through as they were, 64 KiB lines in a
loop grew the log by 3.1 GB in 10 s (seventeenth probe)."""
STDERR_LINE_CHARS = 1024
STDERR_BYTES_PER_MINUTE = 1 << 20
"""Bytes of a server's stderr read a minute: past them, none until the minute ends."""
BLANK_BYTES_PER_MINUTE = 1 << 20
"""Bytes of blank lines a server may write to its stdout a minute: past them it is stopped,
as for an oversized message. They are dropped at C's speed (:data:`_BLANK_LINES`): handled
one by one in Python, newlines written in a loop held the event loop (/health 113-156 ms;
twentieth probe, issue 45)."""
UNASKED_BYTES_PER_MINUTE = 16 << 20
"""Bytes of messages no call of this client asked for (notifications, answers to ids it never
sent, requests of the server's own) a server may send a minute: past them it is stopped. Each
is parsed before it is dropped: lines just under the message bound in a loop held most of a
core for as long as the link was open (twenty-third probe, issue 45; the per-second count of
such messages bounds small ones)."""
_BLANK_LINES = re.compile(rb"\n[ \t\r\n\x0b\x0c]*\n")
"""A line end and the blank lines after it (blank as ``bytes.strip`` reads them: vertical tab
and form feed too; twenty-second probe: lines of those went one by one): one line end is kept."""
_GRACE = 2.0
"""Seconds the process has to exit once its stdin is closed, then after SIGTERM."""
_DRAIN = 1.0
"""Seconds the output of a process that exited is read for before the connection ends
anyway (something the server started keeps its stdout open)."""


class PerMinute:
    """Bytes counted in the current minute, against a bound."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._minute = (0.0, 0)

    def past_bound(self, size: int) -> bool:
        """Counts ``size`` bytes; True once the minute holds more than the bound."""
        now = time.monotonic()
        start, count = self._minute
        self._minute = (start, count + size) if now - start < 60.0 else (now, size)
        return self._minute[1] > self.bound


class PerSecond:
    """Messages counted in the current second, against :data:`MAX_NOTIFICATIONS_PER_SECOND`."""

    def __init__(self) -> None:
        self._second = (0.0, 0)
        """The second being counted (its start), and its count."""

    def past_bound(self) -> bool:
        """Counts one message; True once the second holds more than the bound."""
        now = time.monotonic()
        start, count = self._second
        self._second = (start, count + 1) if now - start < 1.0 else (now, 1)
        return self._second[1] > MAX_NOTIFICATIONS_PER_SECOND


async def message_past_bounds(message: bytes) -> tuple[str, str | None] | None:
    """:func:`._json_bounds.json_past_bounds` for an MCP message, within
    :data:`MAX_MESSAGE_KEYS` and :data:`MAX_MESSAGE_ITEMS`."""
    return await json_past_bounds(message, MAX_MESSAGE_KEYS, MAX_MESSAGE_ITEMS)


def is_notification(message: object) -> bool:
    """Whether a decoded JSON-RPC message is a notification (a method, no id)."""
    return isinstance(message, dict) and "method" in message and "id" not in message


class StdioLink:
    """One stdio connection's state: why it ended (``None`` while it lasts)."""

    def __init__(self, command: tuple[str, ...], max_bytes: int, name: str = "") -> None:
        self.command = command
        self.name = name or os.path.basename(command[0])
        """What the log calls it (the configured label)."""
        self.max_bytes = max_bytes
        self.ended: str | None = None
        self._notifications = PerSecond()
        self._others = PerSecond()
        self._blank = PerMinute(BLANK_BYTES_PER_MINUTE)
        self._unasked = PerMinute(UNASKED_BYTES_PER_MINUTE)
        self._asked: set[str | int] = set()
        """Ids of this client's requests not yet answered."""

    @contextlib.asynccontextmanager
    async def transport(self) -> AsyncIterator[tuple[Any, Any]]:
        """The MCP SDK's transport shape: (read stream, write stream) of its messages,
        while the process runs; on exit the process is stopped (its whole group)."""
        from mcp.client.stdio import get_default_environment
        from mcp.shared.message import SessionMessage

        process = await anyio.open_process(
            list(self.command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # into our log, bounded (_relay_stderr)
            env=get_default_environment(),  # not ours: API keys and tokens stay here
            start_new_session=os.name == "posix",
        )
        self._asked = set()  # a new session's ids
        reading, read_stream = anyio.create_memory_object_stream[Any](0)
        write_stream, writing = anyio.create_memory_object_stream[SessionMessage](0)
        read = anyio.Event()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._read, process, reading, read)
            tasks.start_soon(self._write, process, writing)
            tasks.start_soon(self._watch, process, reading, read)
            tasks.start_soon(self._relay_stderr, process)
            try:
                yield read_stream, write_stream
            finally:
                with anyio.CancelScope(shield=True):
                    read_stream.close()
                    write_stream.close()
                    await _stop(process)
                    with contextlib.suppress(Exception):
                        await process.aclose()  # its pipes
                tasks.cancel_scope.cancel()

    async def _read(self, process: anyio.abc.Process, reading: Any, read: anyio.Event) -> None:
        assert process.stdout is not None
        buffer = bytearray()
        async with reading:
            try:
                async for chunk in process.stdout:
                    kept = _BLANK_LINES.sub(b"\n", chunk)
                    if self._blank.past_bound(len(chunk) - len(kept)):
                        self._stop_for(process, f"more than {BLANK_BYTES_PER_MINUTE} bytes of blank lines in a minute")
                        return
                    chunk = kept
                    start = 0
                    while (end := chunk.find(b"\n", start)) >= 0:
                        buffer += chunk[start:end]
                        start = end + 1
                        if not await self._deliver(bytes(buffer), process, reading):
                            return
                        buffer.clear()
                    buffer += chunk[start:]
                    if len(buffer) > self.max_bytes:
                        self._stop_for(process, f"a message of more than {self.max_bytes} bytes")
                        return
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
                pass
            finally:
                if self.ended is None:
                    self.ended = "the MCP server's process ended; it starts again on next use"
                read.set()

    async def _relay_stderr(self, process: anyio.abc.Process) -> None:
        """The process's stderr into the log: a minute's first :data:`STDERR_LINES_PER_MINUTE`
        lines (each cut at :data:`STDERR_LINE_CHARS`), the rest counted with C's speed; past
        :data:`STDERR_BYTES_PER_MINUTE` it is not read until the minute ends (the process
        then waits on its own writes). Lines handled one by one in Python, even those only
        counted, held the event loop: newlines written in a loop took 95% of a core and
        /health 517 ms (eighteenth probe)."""
        assert process.stderr is not None
        minute, logged, dropped, read = time.monotonic(), 0, 0, 0
        line = bytearray()  # the line being read, its first STDERR_LINE_CHARS bytes

        def new_minute() -> None:
            nonlocal minute, logged, dropped, read
            if dropped:
                logger.warning("MCP server %s: %d lines of its stderr were not logged", self.name, dropped)
            minute, logged, dropped, read = time.monotonic(), 0, 0, 0

        try:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, OSError):
                async for chunk in process.stderr:
                    if time.monotonic() - minute >= 60:
                        new_minute()
                    read += len(chunk)
                    start = 0
                    while logged < STDERR_LINES_PER_MINUTE and (end := chunk.find(b"\n", start)) >= 0:
                        line += chunk[start : start + max(0, min(end - start, STDERR_LINE_CHARS - len(line)))]
                        logger.warning("MCP server %s: %s", self.name, line.decode(errors="replace").rstrip())
                        logged += 1
                        line.clear()
                        start = end + 1
                    if logged >= STDERR_LINES_PER_MINUTE:
                        ended = chunk.count(b"\n", start)
                        dropped += ended
                        if ended:
                            line.clear()
                            start = chunk.rfind(b"\n") + 1
                    line += chunk[start : start + max(0, STDERR_LINE_CHARS - len(line))]
                    if read > STDERR_BYTES_PER_MINUTE:
                        await anyio.sleep(max(0.0, minute + 60 - time.monotonic()))
        finally:  # cancelled too (the link closed): the count is logged
            if line and logged < STDERR_LINES_PER_MINUTE:
                logger.warning("MCP server %s: %s", self.name, line.decode(errors="replace").rstrip())
            elif line:
                dropped += 1
            if dropped:
                logger.warning("MCP server %s: %d lines of its stderr were not logged", self.name, dropped)

    async def _watch(self, process: anyio.abc.Process, reading: Any, read: anyio.Event) -> None:
        """Ends the connection once the process has exited, even while its stdout stays open
        (a process it started in a session of its own holds it): what it wrote before it
        exited is read for :data:`_DRAIN` seconds, then the calls waiting fail (the SDK's
        session sees its stream end) and the next use starts the server again."""
        await process.wait()
        with anyio.move_on_after(_DRAIN):
            await read.wait()
        if read.is_set():
            return
        self.ended = (
            f"the MCP server's process ended (exit status {process.returncode}), something it started"
            " keeping its output open; it starts again on next use"
        )
        logger.warning("MCP server %s: %s", self.command[0], self.ended)
        reading.close()  # the SDK's read stream ends: the calls waiting fail
        if process.stdout is not None:
            with contextlib.suppress(Exception):
                await process.stdout.aclose()  # the reader stops

    def _stop_for(self, process: anyio.abc.Process, what: str) -> None:
        self.ended = f"the MCP server sent {what}; it was stopped and starts again on next use"
        logger.warning("MCP server %s: %s", self.command[0], self.ended)
        _kill(process)

    async def _deliver(self, line: bytes, process: anyio.abc.Process, reading: Any) -> bool:
        """Hands one message on; False once nobody reads, or when it cannot be read: the
        process is then stopped, as for an oversized one. (The SDK's session only logs a
        parse error, so a call whose answer was unreadable, nested past the parser's depth
        limit say, waited out the whole call timeout.)"""
        if not line.strip():
            return True
        # Counted before parsing, which costs in proportion to the items: every tool has
        # an inputSchema key, and a quote inside a JSON string is escaped, so none is missed
        # or made up by text.
        if len(line) > _PARSE_INLINE and (listed := line.count(b'"inputSchema"')) > MAX_LISTED_TOOLS:
            self._stop_for(process, f"a list of {listed} tools (at most {MAX_LISTED_TOOLS} are taken)")
            return False
        if (past := await message_past_bounds(line)) is not None:  # the SDK's models of it are made on the loop
            self._stop_for(process, f"a message of {past[0]}")
            return False
        message = _parse(line) if len(line) <= _PARSE_INLINE else await anyio.to_thread.run_sync(_parse, line)
        if isinstance(message, ValueError):
            self._stop_for(process, f"a message that is not JSON-RPC it can read ({_first_line(message)})")
            return False
        from mcp_types import JSONRPCError, JSONRPCResponse

        answer = getattr(message, "message", None)
        if isinstance(answer, JSONRPCResponse | JSONRPCError) and answer.id in self._asked:
            self._asked.discard(answer.id)
        elif self._unasked.past_bound(len(line)):
            self._stop_for(
                process, f"more than {UNASKED_BYTES_PER_MINUTE} bytes in a minute of messages no call asked for"
            )
            return False
        if message is None:  # a notification
            if self._notifications.past_bound():
                self._stop_for(process, f"more than {MAX_NOTIFICATIONS_PER_SECOND} notifications in a second")
                return False
            return True
        # Answers to ids it was never asked, requests of its own (ping, roots/list) in a loop:
        # each handed to the SDK, they held most of a core for as long as the link was open
        # (twenty-second probe, issue 45).
        if self._others.past_bound():
            self._stop_for(process, f"more than {MAX_NOTIFICATIONS_PER_SECOND} other messages in a second")
            return False
        try:
            await reading.send(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False
        return True

    async def _write(self, process: anyio.abc.Process, writing: Any) -> None:
        from mcp_types import JSONRPCRequest

        assert process.stdin is not None
        try:
            async with writing:
                async for outgoing in writing:
                    if isinstance(outgoing.message, JSONRPCRequest):
                        self._asked.add(outgoing.message.id)
                    text = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send(text.encode() + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass  # the process is gone: the reader sees its stdout end


def _parse(line: bytes) -> Any:
    """The SDK's message, ``None`` for a notification (dropped unread by the SDK's models),
    or the ValueError that says why it cannot be read."""
    import mcp_types
    from mcp.shared.message import SessionMessage

    try:
        raw = json.loads(line)
    except ValueError as exc:
        return exc
    except RecursionError:  # it escaped the reader, which ended as if the process had
        return ValueError(NESTED_TOO_DEEP)
    if is_notification(raw):
        return None
    try:
        # From the text again, not from ``raw``: the SDK's own parser and its depth bound.
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


def _first_line(error: ValueError) -> str:
    lines = str(error).strip().splitlines()
    return " ".join(lines[:3])[:200] if lines else type(error).__name__


def _kill(process: anyio.abc.Process, signum: int = signal.SIGKILL if os.name == "posix" else 9) -> None:
    """``signum`` to the server's process group (it may have started others)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.name == "posix":
            os.killpg(process.pid, signum)
        elif signum == signal.SIGTERM:
            process.terminate()
        else:
            process.kill()


async def _stop(process: anyio.abc.Process) -> None:
    """Closes stdin (MCP's way to ask a stdio server to exit), then SIGTERM, then SIGKILL."""
    if process.stdin is not None:
        with contextlib.suppress(Exception):
            await process.stdin.aclose()
    for then in (signal.SIGTERM, None):
        with anyio.move_on_after(_GRACE):
            await process.wait()
            break
        if then is not None:
            _kill(process, then)
    else:
        _kill(process)
        with anyio.move_on_after(_GRACE):
            await process.wait()
    # What it started in its group and left running when it exited goes with it (twenty-third
    # probe, issue 45: children it forked outlived it, and this server's exit).
    _kill(process)
