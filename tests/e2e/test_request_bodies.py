"""What request bodies can do to a real `ortserve serve` process: stall, trickle, keep
coming after the answer, pile up in memory, and hold every connection slot."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path

import httpx
import pytest
from test_connections import serving

pytestmark = pytest.mark.timing  # wall-clock bounds: run apart (see the README's test command)

CHAT = "/v1/chat/completions"


def _post_head(port: int, length: int, path: str = CHAT, key: str | None = None) -> socket.socket:
    """A connection that has sent a POST's head announcing ``length`` body bytes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode())
    return sock


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _answer(sock: socket.socket, within: float) -> bytes:
    """What the server sent before closing ``sock`` (failing if it stays open ``within`` s)."""
    sock.settimeout(within)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {within} s: {received[:200]!r}") from None
    return received


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024


def test_a_stalled_or_trickling_body_gets_408_and_the_server_serves_on() -> None:
    with ExitStack() as stack, serving("--body-timeout", "1", "--body-min-rate", "1024") as (process, url):
        port = int(url.rsplit(":", 1)[1])
        stalled = stack.enter_context(_post_head(port, 1_000_000))
        stalled.sendall(b'{"model": "tiny", "messages": [' + b" " * 500_000)
        start = time.monotonic()
        answer = _answer(stalled, within=10)
        assert time.monotonic() - start < 4
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"

        trickling = stack.enter_context(_post_head(port, 10_000))
        start = time.monotonic()
        with pytest.raises(OSError):  # broken pipe or reset once the server closed it
            for _ in range(100):
                trickling.sendall(b" ")
                time.sleep(0.2)
        assert time.monotonic() - start < 5
        with httpx.Client() as client:
            assert client.get(f"{url}/health").status_code == 200
        assert process.poll() is None


def test_a_body_still_coming_after_the_answer_is_cut() -> None:
    """A 401 answers before the body is read; uvicorn then drops what follows, and a body
    trickling in held the connection open for as long as it came."""
    with serving("--body-timeout", "1", "--api-key", "k") as (_, url), _post_head(_port(url), 10_000_000) as sock:
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401 ")
        start = time.monotonic()
        with pytest.raises(OSError):
            for _ in range(100):
                sock.sendall(b" " * 100)
                time.sleep(0.2)
        assert time.monotonic() - start < 5


def _chunked(body: bytes, size: int) -> bytes:
    """``body`` as a chunked POST's body in chunks of ``size`` bytes, with its final chunk."""
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def test_a_body_in_tiny_chunks_is_refused_while_health_answers() -> None:
    """Issue 45, seventh probe: h11 parses each chunk of a chunked body in Python (7 us
    apiece), so 200,000 one-byte chunks (1.2 MB on the wire) held the event loop 0.6 s,
    0.3 s each 256 KiB read, whatever the route did with the body."""
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body = json.dumps(request).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    slowest: list[float] = []
    with serving() as (process, url), httpx.Client(base_url=url, timeout=30) as client:
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(0.02):
                sent = time.perf_counter()
                client.get("/health")
                slowest.append(time.perf_counter() - sent)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as tiny:
                with suppress(OSError):  # the server may close before it has read it all
                    tiny.sendall(head + _chunked(body + b" " * (200_000 - len(body)), 1))
                answer = _answer(tiny, within=10)
        finally:
            stop.set()
            poller.join()
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "body_pieces_too_small", error
        assert max(slowest) < 0.1, f"/health took {max(slowest) * 1000:.0f} ms"
        # Chunks of 40 bytes (as small as a client sends unless told to) are taken as before.
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as fine:
            fine.sendall(head + _chunked(body + b" " * (80_000 - len(body)), 40))
            fine.settimeout(30)
            assert fine.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert process.poll() is None


def test_bodies_in_memory_are_bounded_and_refused_with_503() -> None:
    """The probe's case, scaled: 24 connections each send 15 MB of a 16 MB body and stall.
    With a 64 MiB budget the server holds at most that (then 503s the rest before reading
    them); the ones it holds are cut by the rate limit, and memory comes back."""
    total = 16 * 1024 * 1024
    sent = 15 * 1024 * 1024
    with (
        ExitStack() as stack,
        serving("--body-timeout", "3", "--max-body-memory-mb", "64") as (process, url),
    ):
        port = int(url.rsplit(":", 1)[1])
        with httpx.Client() as client:
            assert client.get(f"{url}/health").status_code == 200
        before = _rss(process.pid)
        socks = []
        for _ in range(24):
            sock = _post_head(port, total)
            stack.callback(sock.close)
            socks.append(sock)

        def pour(sock: socket.socket) -> None:
            with suppress(OSError):  # refused and closed mid-send
                sock.sendall(b'{"model": "tiny", "messages": [' + b" " * (sent - 32))

        pourers = [threading.Thread(target=pour, args=(s,)) for s in socks]
        for thread in pourers:
            thread.start()
        for thread in pourers:
            thread.join(30)
        time.sleep(0.5)
        held = _rss(process.pid) - before
        # A request that fits the budget's rest still runs; a big one gets 503 meanwhile.
        with httpx.Client(timeout=30) as client:
            big = client.post(
                f"{url}{CHAT}", content=b" " * (8 * 1024 * 1024), headers={"content-type": "application/json"}
            )
        assert big.status_code == 503, big.text
        assert big.headers["retry-after"] == "1"
        assert big.json()["error"]["code"] == "server_overloaded"
        assert "--max-body-memory-mb" in big.json()["error"]["message"]
        answers = [_answer(s, within=30) for s in socks]
        refused = sum(a.startswith(b"HTTP/1.1 503 ") for a in answers)
        timed_out = sum(a.startswith(b"HTTP/1.1 408 ") for a in answers)
        assert refused + timed_out == 24, [a[:40] for a in answers]
        print(f"held {held / 2**20:.0f} MiB, {refused} refused (503), {timed_out} cut (408)")
        assert 0 < timed_out <= 4 and refused >= 20
        assert held < 160 * 1024 * 1024, held  # 24 x 15 MB was 360 MB and more
        with httpx.Client(timeout=30) as client:
            reply = client.post(
                f"{url}{CHAT}", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            )
        assert reply.status_code == 200, reply.text
        assert process.poll() is None


def test_a_fresh_client_is_served_while_slow_bodies_hold_every_slot() -> None:
    """The probe's 1,000 dripping connections, scaled to a cap of 60: the server closes
    the connection waiting longest for its request, so /health is answered at once."""
    with (
        ExitStack() as stack,
        serving("--max-connections", "60", "--body-timeout", "30", "--grace-period", "0.5") as (_, url),
    ):
        port = int(url.rsplit(":", 1)[1])
        drippers = []
        for _ in range(60):
            sock = _post_head(port, 1_000_000)
            stack.callback(sock.close)
            drippers.append(sock)
        stop = threading.Event()

        def drip() -> None:
            while not stop.wait(0.5):
                for sock in drippers:
                    with suppress(OSError):
                        sock.sendall(b" ")

        dripping = threading.Thread(target=drip)
        dripping.start()
        try:
            time.sleep(1)
            for _ in range(3):
                start = time.monotonic()
                with httpx.Client(timeout=10) as client:
                    assert client.get(f"{url}/health").status_code == 200
                assert time.monotonic() - start < 2
        finally:
            stop.set()
            dripping.join()


@pytest.fixture(autouse=True)
def _no_proc() -> Iterator[None]:
    if not Path("/proc/self/status").exists():
        pytest.skip("reads the server's memory from /proc")
    yield
