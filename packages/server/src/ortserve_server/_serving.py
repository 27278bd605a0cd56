"""What ``ortserve serve`` adds around uvicorn so that connections cannot exhaust it.

- :func:`listen` makes the listening socket as a TCP socket (``IPPROTO_TCP``): asyncio
  turns Nagle off (TCP_NODELAY) only on accepted sockets whose protocol says TCP, and a
  socket made with protocol 0 left every keep-alive request waiting ~40 ms for the
  client's delayed ACK.
- :class:`GuardedH11Protocol` is uvicorn's h11 protocol plus what it lacks: a deadline for
  a request's head (uvicorn arms no timer before the first request, and any byte cancels
  its keep-alive timer, so idle and slowloris connections were held forever), and a cap
  on open connections (one past it is closed as soon as it is accepted, before it can
  use up file descriptors the server needs).
- :func:`raise_fd_limit` lifts RLIMIT_NOFILE's soft limit to the hard one.
- :class:`AcceptErrorLog` reports "out of file descriptors" once per interval: asyncio
  logs a traceback for every failed ``accept()``, up to the listen backlog per loop
  turn, which wrote hundreds of thousands of them a minute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "AcceptErrorLog",
    "ConnectionLimits",
    "GuardedH11Protocol",
    "default_max_connections",
    "listen",
    "raise_fd_limit",
]

logger = logging.getLogger("ortserve.server")

FD_RESERVE = 64
"""File descriptors kept back from connections for models, logs and the event loop."""


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The per-connection limits ``ortserve serve`` enforces (flags of the same names)."""

    header_timeout: float = 10.0
    """Seconds a request's head (request line and headers) may take to arrive in full,
    counted from the connection opening or from the end of the previous response."""
    max_connections: int = 1000
    """Open connections at most; more are closed as soon as they are accepted."""


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn; ``OSError`` if the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: accepted sockets inherit the protocol number, and asyncio sets
    # TCP_NODELAY only when it reads IPPROTO_TCP there (base_events._set_nodelay).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit; returns the soft limit now in
    force (unchanged where the platform refuses, or has no such limit)."""
    try:
        import resource
    except ImportError:  # Windows: no RLIMIT_NOFILE
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS caps the soft limit below an "unlimited" hard one
            logger.info("could not raise the open file limit from %d to %d: %s", soft, hard, exc)
        else:
            soft = hard
    return soft


def default_max_connections(fd_limit: int) -> int:
    """Connections allowed by default: 1000, or fewer where the open file limit would not
    leave :data:`FD_RESERVE` descriptors for everything else."""
    if fd_limit <= 0:  # unknown, or RLIM_INFINITY (-1 on Linux)
        return 1000
    return max(1, min(1000, fd_limit - FD_RESERVE))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap.

    The head deadline runs whenever the connection waits for a request (h11 says both
    sides are IDLE): from the connection opening, and from the end of each response. It
    is absolute, so a client trickling one header byte a second is cut like one that
    sends nothing. A connection past :attr:`ConnectionLimits.max_connections` is closed
    at once: the descriptor comes back at once and the client sees a close, not a hang.
    """

    limits = ConnectionLimits()

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedH11Protocol]:
        """This protocol class with ``limits`` (uvicorn builds protocols from a class)."""
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            _CONNECTION_CAP_LOG.report(f"more than {self.limits.max_connections} open connections (--max-connections)")
            transport.abort()
            return
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def _watch_head(self) -> None:
        """Arm the head deadline when a request is awaited, drop it once one arrived."""
        awaiting = self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE
        if awaiting and self._head_deadline is None and not self.transport.is_closing():
            self._head_deadline = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)
        elif not awaiting:
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            # As uvicorn's keep-alive timeout does: nothing to answer, just close.
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()


class _OncePerInterval:
    """A warning logged at most once per ``interval`` seconds, with how many it stands for."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def report(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        logger.warning("refusing connections: %s%s", what, more)
        self._last, self._suppressed = now, 0


_CONNECTION_CAP_LOG = _OncePerInterval(10.0)


class AcceptErrorLog:
    """An event loop exception handler that turns asyncio's per-``accept()`` traceback for
    EMFILE/ENFILE/ENOBUFS/ENOMEM into one warning per ``interval`` seconds; everything
    else goes to the loop's default handler."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, interval: float = 10.0) -> None:
        self._log = _OncePerInterval(interval)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != self.MESSAGE:
            loop.default_exception_handler(context)
            return
        exc = context.get("exception")
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        self._log.report(f"accept() failed: {reason}; raise the open file limit or lower --max-connections")
