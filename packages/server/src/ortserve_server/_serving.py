"""What ``ortserve serve`` adds around uvicorn so that connections cannot exhaust it.

- :func:`listen` makes the listening socket as a TCP socket (``IPPROTO_TCP``): asyncio
  turns Nagle off (TCP_NODELAY) only on accepted sockets whose protocol says TCP, and a
  socket made with protocol 0 left every keep-alive request waiting ~40 ms for the
  client's delayed ACK.
- :class:`GuardedH11Protocol` is uvicorn's h11 protocol plus what it lacks: a deadline for
  a request's head (uvicorn arms no timer before the first request, and any byte cancels
  its keep-alive timer, so idle and slowloris connections were held forever), a minimum
  rate for its body (a client that sent 15 MB of a 16 MB body and stalled held it for as
  long as it liked, and one dripping a byte every 5 s held its connection), and a cap on
  open connections (past it, the connection that has waited longest for its request is
  closed, so a fresh client is served even while a thousand slow ones hold every slot),
  and a floor on a body's piece size (h11 parses each chunk of a chunked body in Python,
  7 us apiece: 200,000 one-byte chunks held the event loop 0.6 s, 0.3 s per 256 KiB read),
  and a deadline for a client that stops reading its answer (an answer is held until it is
  sent: twenty clients that never read 16.6 MB embeddings answers held 428 MiB for as long
  as they stayed connected).
- :func:`raise_fd_limit` lifts RLIMIT_NOFILE's soft limit to the hard one.
- :class:`AcceptErrorLog` reports "out of file descriptors" once per interval: asyncio
  logs a traceback for every failed ``accept()``, up to the listen backlog per loop
  turn, which wrote hundreds of thousands of them a minute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import socket
import struct
import time
import urllib.parse
from http import HTTPStatus
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import fcntl
    import termios
except ImportError:  # Windows: no ioctl, so a paused send times out without asking the socket
    fcntl = termios = None  # type: ignore[assignment]

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
    body_timeout: float = 10.0
    """Seconds in which a request's body must bring ``body_min_rate`` bytes a second (a
    stalled or trickling body is answered 408 and its connection closed)."""
    body_min_rate: int = 1024
    """Bytes a second a request's body must average over each ``body_timeout`` window
    (Apache's mod_reqtimeout ``MinRate``); time the server itself is not reading is not counted."""
    max_connections: int = 1000
    """Open connections at most; past it, the one waiting longest for its request goes."""
    send_timeout: float = 60.0
    """Seconds an answer may wait for the client to take any of it (the connection's send
    buffer full, and on Linux its socket's queue not shrinking, all that time); past it the
    connection closes and the answer is dropped."""


BODY_MIN_PIECE = 32
"""Bytes a request body's pieces (its chunks, or its reads) must average once it has come
in :data:`BODY_PIECES_FREE` pieces; a body in smaller ones gets 400 and its connection is
closed. h11 parses each piece in Python, so a body's cost on the event loop follows its
piece count, not its size: at 32 bytes, a 256 KiB read is 7,000 pieces (50 ms). No client
library sends smaller chunks than that unless told to."""
BODY_PIECES_FREE = 1024
"""Pieces a request body may come in before their average size is checked (7 ms of h11)."""


_BUFFER_REPR = re.compile(r"(?:bytearray\()?\bb('.*?'|\".*?\")\)?")


class _PieceCountingConnection(h11.Connection):
    """h11's server connection, counting the current request's body pieces (``Data``
    events) and their bytes; once they are too small (:data:`BODY_MIN_PIECE` on average, past
    :data:`BODY_PIECES_FREE`) it stops parsing (:attr:`too_small`) and reports no more
    events, for the protocol to refuse the request. A request line and headers longer than
    ``max_head`` are a protocol error with status 431, whether they came in pieces (h11's
    own limit) or in one read (which h11 takes whole); a request with both
    ``Transfer-Encoding`` and ``Content-Length`` one with status 400 (RFC 9112, 6.3: h11
    takes the chunks, a proxy in front may take the length, and the rest of the body
    becomes a smuggled request). :attr:`head_refused` says why, for the answer."""

    def __init__(self, max_head: int) -> None:
        super().__init__(h11.SERVER, max_head)
        self.max_head = max_head
        self.pieces = 0
        self.piece_bytes = 0
        self.too_small = False
        self.head_refused: tuple[int, str, str] | None = None
        """The status, message and code of the answer to a head refused here."""
        self.protocol_error: str | None = None
        """Why h11 could not parse what came (a malformed request line, header or chunk)."""

    def next_event(self) -> Any:
        if self.too_small:
            return h11.NEED_DATA
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            if exc.error_status_hint == 431:  # h11's own: a head still incomplete
                self._refuse_head(431, "request_header_fields_too_large")
            if self.head_refused is None:  # h11's reason, for the answer (uvicorn drops it)
                # h11 quotes the line as Python's repr of its buffer: bytearray(b'...') -> '...'
                self.protocol_error = _BUFFER_REPR.sub(r"\1", str(exc))
            raise
        if isinstance(event, h11.Request):
            head = len(event.method) + len(event.target)
            head += sum(len(name) + len(value) + 4 for name, value in event.headers)  # ": ", CRLF
            if head > self.max_head:
                self._refuse_head(431, "request_header_fields_too_large")
            names = {name for name, _ in event.headers}  # h11 gives them lower-case
            if b"transfer-encoding" in names and b"content-length" in names:
                self._refuse_head(400, "ambiguous_body_length")
            if event.target.lower().startswith((b"http://", b"https://")):
                event = self._origin_form(event)
            self.pieces = self.piece_bytes = 0
        elif isinstance(event, h11.Data):
            self.pieces += 1
            self.piece_bytes += len(event.data)
            if self.pieces > BODY_PIECES_FREE and self.piece_bytes < BODY_MIN_PIECE * self.pieces:
                self.too_small = True
                return h11.NEED_DATA
        return event

    def _origin_form(self, event: h11.Request) -> h11.Request:
        """A request whose target is in absolute-form (``GET http://host/v1/models``, as
        clients send to a proxy), which a server must accept (RFC 9112, 3.2.2), as its
        origin-form: the path and query. Its authority must be the Host header (which the
        site checks read), else it is refused (400): it was a 404 "no route"."""
        target = urllib.parse.urlsplit(event.target.decode("ascii", "replace"))
        host = next((value for name, value in event.headers if name == b"host"), b"")
        if target.netloc.lower() != host.decode("ascii", "replace").lower():
            self._refuse_head(400, "host_mismatch")
        path = (target.path or "/") + (f"?{target.query}" if target.query else "")
        return h11.Request(method=event.method, target=path, headers=event.headers, http_version=event.http_version)

    def _refuse_head(self, status: int, code: str) -> None:
        message = {
            "request_header_fields_too_large": f"the request line and headers are longer than this server's "
            f"{self.max_head} bytes",
            "ambiguous_body_length": "the request has both Transfer-Encoding and Content-Length; send one "
            "(RFC 9112, 6.3)",
            "host_mismatch": "the request target's authority is not its Host header (RFC 9112, 3.2.2)",
        }[code]
        self.head_refused = (status, message, code)
        raise h11.RemoteProtocolError(message, error_status_hint=status)


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
    """uvicorn's h11 protocol with a request-head deadline, a body rate, a connection cap
    and a deadline for a client that does not read its answer.

    The head deadline runs whenever the connection waits for a request (h11 says both
    sides are IDLE): from the connection opening, and from the end of each response. It
    is absolute, so a client trickling one header byte a second is cut like one that
    sends nothing. While a body is coming, every :attr:`ConnectionLimits.body_timeout`
    seconds must bring :attr:`ConnectionLimits.body_min_rate` bytes a second, whether the
    app still reads it or has answered already (uvicorn then drops the rest, and every
    byte would hold the connection open). A connection past
    :attr:`ConnectionLimits.max_connections` closes the connection that has waited
    longest for its request (head or body), or itself when every other is being answered:
    the descriptor comes back at once and that client sees a close, not a hang. An answer
    whose client takes nothing of it for :attr:`ConnectionLimits.send_timeout` seconds (the
    transport's buffer full: asyncio paused writing) has its connection aborted.
    """

    limits = ConnectionLimits()

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedH11Protocol]:
        """This protocol class with ``limits`` (uvicorn builds protocols from a class)."""
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own connection, made the way uvicorn makes it, plus the piece count.
        size = self.config.h11_max_incomplete_event_size
        self.conn = _PieceCountingConnection(DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._body_check: asyncio.TimerHandle | None = None
        self._body_bytes = 0
        """Body bytes received in the current ``body_timeout`` window."""
        self._send_deadline: asyncio.TimerHandle | None = None
        self._send_queue = 0
        """The answer's bytes not yet taken by the client when the send deadline was armed."""
        self.waiting_since: float | None = None
        """When this connection began waiting for its current request (head or body);
        ``None`` while a request is being answered. The connection cap closes the oldest."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.waiting_since = time.monotonic()
        if len(self.connections) > self.limits.max_connections:
            waiting = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c is not self]
            waiting = [c for c in waiting if c.waiting_since is not None and not c.transport.is_closing()]
            oldest = min(waiting, key=lambda c: c.waiting_since or 0.0, default=None)
            what = f"more than {self.limits.max_connections} open connections (--max-connections)"
            if oldest is None:
                _CONNECTION_CAP_LOG.report(f"refusing connections: {what}")
                transport.abort()
                return
            _CONNECTION_CAP_LOG.report(f"{what}: closing the one that waited longest for its request")
            oldest.transport.abort()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_body_check()
        self._stop_send_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is full: the client has not taken what was sent."""
        super().pause_writing()
        if self._send_deadline is None:
            self._send_queue = self._untaken()
            self._send_deadline = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._stop_send_deadline()
        super().resume_writing()

    def _stop_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_timed_out(self) -> None:
        """``send_timeout`` seconds with the transport paused: close the connection unless
        the client took some of the answer meanwhile (its untaken bytes shrank: a slow
        reader, whose kernel buffer of megabytes wakes the writer only once it is a third
        empty, is not a stalled one; where the socket cannot be asked, the transport's own
        buffer still shows what the kernel took). uvicorn then marks the request
        disconnected, so the rest of its answer goes nowhere and is freed (a stream's
        generation ends as when a client leaves)."""
        self._send_deadline = None
        if self.transport.is_closing():
            return
        queue = self._untaken()
        if queue < self._send_queue:
            self._send_queue = queue
            self._send_deadline = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)
            return
        _SEND_TIMEOUT_LOG.report(
            f"closing a connection: its client took nothing of its answer for {self.limits.send_timeout:g} s "
            "(--send-timeout)",
            level=logging.INFO,
        )
        self.transport.abort()  # close() would wait to flush the buffer the client does not read

    def _untaken(self) -> int:
        """Bytes of the answer the client has not taken: the transport's buffer and, where
        the socket can be asked, the kernel's. Paused, nothing is added to either, so the sum
        shrinks exactly when the client reads (the kernel's alone may stay full while the
        transport refills it)."""
        return self.transport.get_write_buffer_size() + (_unsent_bytes(self.transport) or 0)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes += len(data)
        super().data_received(data)
        self._watch_head()

    def handle_events(self) -> None:
        super().handle_events()
        conn = self.conn
        if isinstance(conn, _PieceCountingConnection) and conn.too_small and not self.transport.is_closing():
            _BODY_PIECE_LOG.report(
                f"closing a connection: its request body came in {conn.pieces} pieces of {conn.piece_bytes} bytes "
                f"(at least {BODY_MIN_PIECE} bytes a piece on average)",
                level=logging.INFO,
            )
            self._refuse(
                400,
                f"the request body came in pieces of {conn.piece_bytes // conn.pieces} bytes on average; this server "
                f"takes {BODY_MIN_PIECE} or more (send it in larger chunks)",
                "body_pieces_too_small",
            )
            return
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def _watch_head(self) -> None:
        """Arm the head deadline when a request is awaited, drop it once one arrived; watch
        the body's rate while one comes."""
        if self.transport.is_closing():
            return
        theirs = self.conn.their_state
        awaiting = self.conn.our_state is h11.IDLE and theirs is h11.IDLE
        if awaiting and self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)
        elif not awaiting:
            self._stop_head_timer()
        if theirs is h11.SEND_BODY and self._body_check is None:
            self._body_bytes = 0
            self._body_check = self.loop.call_later(self.limits.body_timeout, self._check_body_rate)
        receiving = theirs is h11.IDLE or theirs is h11.SEND_BODY
        if not receiving:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = time.monotonic()

    def _stop_head_timer(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _stop_body_check(self) -> None:
        if self._body_check is not None:
            self._body_check.cancel()
            self._body_check = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            # As uvicorn's keep-alive timeout does: nothing to answer, just close.
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    def _check_body_rate(self) -> None:
        """End of a ``body_timeout`` window: enough body bytes, or 408 and close."""
        self._body_check = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        enough = self._body_bytes >= self.limits.body_min_rate * self.limits.body_timeout
        # Reading paused: the app is not taking the body yet (uvicorn holds 64 KiB for it),
        # so the client could not send; the window starts again.
        if enough or self.flow.read_paused:
            self._body_bytes = 0
            self._body_check = self.loop.call_later(self.limits.body_timeout, self._check_body_rate)
            return
        _BODY_RATE_LOG.report(
            f"closing a connection: its request body came slower than {self.limits.body_min_rate} bytes/s over "
            f"{self.limits.body_timeout:g} s (--body-min-rate, --body-timeout)",
            level=logging.INFO,
        )
        self._refuse(
            408, f"the request body came too slowly (at least {self.limits.body_min_rate} bytes/s)", "request_timeout"
        )

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 could not parse, in the API's error shape (uvicorn
        sends a plain "Invalid HTTP request received."): a head refused here (past
        ``--max-header-size``: 431; an ambiguous body length: 400) says why, and so does any
        other request h11 could not read (a malformed line, header or chunk: 400)."""
        conn = self.conn
        if isinstance(conn, _PieceCountingConnection) and conn.head_refused is not None:
            self._refuse(*conn.head_refused, app_started=False)
            return
        why = conn.protocol_error if isinstance(conn, _PieceCountingConnection) else None
        message = "the request is not valid HTTP/1.1" + (f": {why}" if why else "")
        if conn.our_state is h11.IDLE:  # its head: no app has it
            self._refuse(400, message, "invalid_http_request", app_started=False)
        elif conn.our_state is h11.SEND_RESPONSE:  # its body: the app's answer, not begun, goes nowhere
            self._refuse(400, message, "invalid_http_request")
        else:  # the app's answer has begun: nothing else can be said on this connection
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str, *, app_started: bool = True) -> None:
        """Answer ``status`` with the API's error shape where the app has not begun to
        answer (its own answer, if it comes, goes nowhere), and close the connection.
        ``app_started``: the request reached the app (``False``: its head was refused)."""
        cycle = self.cycle
        if app_started:
            answering = cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE
        else:
            answering = True  # h11 lets a server answer a request it could not parse
        if answering:
            if app_started and cycle is not None:
                cycle.disconnected = True  # the app's own answer, if it comes, goes nowhere
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
            body = json.dumps({"error": error}).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            reason = HTTPStatus(status).phrase.encode()
            answer = h11.Response(status_code=status, headers=headers, reason=reason)
            for event in (answer, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        self.transport.close()


def _unsent_bytes(transport: asyncio.BaseTransport) -> int | None:
    """Bytes the kernel still holds for the peer on ``transport``'s socket (Linux's
    SIOCOUTQ), or ``None`` where that cannot be asked."""
    sock = transport.get_extra_info("socket")
    request = getattr(termios, "TIOCOUTQ", None) if termios is not None else None
    if sock is None or request is None:
        return None
    try:
        (unsent,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))
    except OSError:
        return None
    return int(unsent)


class _OncePerInterval:
    """A warning logged at most once per ``interval`` seconds, with how many it stands for."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last = -float("inf")
        self._suppressed = 0

    def report(self, what: str, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        logger.log(level, "%s%s", what, more)
        self._last, self._suppressed = now, 0


_CONNECTION_CAP_LOG = _OncePerInterval(10.0)
_BODY_RATE_LOG = _OncePerInterval(10.0)
_BODY_PIECE_LOG = _OncePerInterval(10.0)
_SEND_TIMEOUT_LOG = _OncePerInterval(10.0)


class AcceptErrorLog:
    """An event loop exception handler that turns asyncio's per-``accept()`` traceback for
    EMFILE/ENFILE/ENOBUFS/ENOMEM into one warning per ``interval`` seconds, drops the
    retry's error after shutdown, and passes everything else to the loop's default handler."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, interval: float = 10.0) -> None:
        self._log = _OncePerInterval(interval)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ValueError) and "_start_serving" in repr(context.get("handle")):
            # After such a failure asyncio retries accept() on a timer that closing the
            # server does not cancel; firing after shutdown, it finds the socket closed.
            return
        if context.get("message") != self.MESSAGE:
            loop.default_exception_handler(context)
            return
        exc = context.get("exception")
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        self._log.report(
            f"refusing connections: accept() failed: {reason}; raise the open file limit or lower --max-connections"
        )
