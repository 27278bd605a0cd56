"""What connections can do to a real `ortserve serve` process: Nagle on keep-alive
requests, idle and slowloris connections, file descriptor exhaustion."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest

pytestmark = pytest.mark.timing  # wall-clock bounds: run apart (see the README's test command)

TINY_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2"
resource = pytest.importorskip("resource")  # RLIMIT_NOFILE: POSIX only


_LOGS: dict[int, IO[str]] = {}


@contextmanager
def serving(
    *args: str,
    preexec_fn: Callable[[], None] | None = None,
    launcher: Callable[[list[str]], list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """An ``ortserve serve`` process on a free port; :func:`stopped_log` stops it and reads
    what it wrote to stderr. ``launcher``: the command that runs it, given its own (one that
    execs it, so that the process is the server); ``env``: variables added to this process's.

    Its stderr goes to a file, not a pipe nobody reads: its access log filled the pipe's
    64 KiB in a test of a 500-line batch, and the server blocked in its next log line."""
    command = [sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json"]
    command = [*command, "--model", f"tiny={TINY_MODEL}", *args]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            launcher(command) if launcher is not None else command,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, **env} if env is not None else None,
            preexec_fn=preexec_fn,  # noqa: PLW1509  # only sets a resource limit
        )
        _LOGS[process.pid] = log
        assert process.stdout is not None
        line = process.stdout.readline()
        try:
            if not line:
                raise AssertionError(f"server exited: {stopped_log(process)}")
            yield process, f"http://127.0.0.1:{json.loads(line)['port']}"
        finally:
            stopped_log(process)
            process.stdout.close()
            del _LOGS[process.pid]


def stopped_log(process: subprocess.Popen[str]) -> str:
    """Stop a :func:`serving` process (SIGTERM, unless it has ended) and wait for it: what it
    wrote to stderr."""
    if process.poll() is None:
        process.terminate()
    process.wait(timeout=30)
    log = _LOGS[process.pid]
    log.seek(0)
    return log.read()


def _fd_limit(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_idle(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]


def _closed_by_server(sock: socket.socket, within: float) -> float:
    """Seconds until the server closed ``sock`` (EOF or reset), failing after ``within``."""
    start = time.monotonic()
    sock.settimeout(within)
    try:
        assert sock.recv(1024) == b"", "the server answered instead of closing"
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {within} s") from None
    return time.monotonic() - start


def test_accepted_sockets_get_tcp_nodelay() -> None:
    """asyncio sets TCP_NODELAY only on sockets whose protocol reads IPPROTO_TCP, which
    accepted sockets inherit from the listening socket that ``listen`` makes."""
    from ortserve_server._serving import listen

    async def check() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def accepted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = listen("127.0.0.1", 0)
        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(check()) != 0


def test_keep_alive_requests_are_not_held_by_nagle() -> None:
    # Without TCP_NODELAY each request of a reused connection waited for the client's
    # delayed ACK: a median of ~44 ms here, against under 1 ms with it.
    with serving() as (_, url), httpx.Client() as client:
        client.get(f"{url}/health")
        times = []
        for _ in range(20):
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.02, times


def test_idle_and_slowloris_connections_are_closed() -> None:
    with serving("--header-timeout", "1", "--keep-alive-timeout", "1") as (process, url):
        port = int(url.rsplit(":", 1)[1])
        idle = socket.create_connection(("127.0.0.1", port))
        assert _closed_by_server(idle, within=10) < 3
        slow = socket.create_connection(("127.0.0.1", port))
        start = time.monotonic()
        with pytest.raises(OSError):  # broken pipe or reset once the server closed it
            for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                slow.sendall(bytes([byte]))
                time.sleep(0.1)
                assert time.monotonic() - start < 10, "a one-byte-per-100-ms header was never cut"
        assert time.monotonic() - start < 3
        # A keep-alive connection that answered a request is closed once idle, too.
        with httpx.Client() as client:
            assert client.get(f"{url}/health").status_code == 200
        idle.close()
        slow.close()
        assert process.poll() is None


def test_an_answer_nobody_reads_is_dropped_after_the_send_timeout() -> None:
    """Eighth probe of issue 45: an answer is held until it is sent, and a client that
    never read it kept it (and its connection) for as long as it stayed connected: twenty
    clients asking for 16.6 MB embeddings answers held 428 MiB. Here a 20 MB file's
    content, asked for on a connection that reads nothing: past --send-timeout the server
    closes it, and what the client can still read is what the buffers held, not the file."""
    body = {"model": "tiny", "prompt": "y" * 5000}
    lines = ({"custom_id": f"{i}", "method": "POST", "url": "/v1/completions", "body": body} for i in range(4000))
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with serving("--send-timeout", "0.5") as (process, url), httpx.Client(base_url=url, timeout=60) as client:
        uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", content)})
        assert uploaded.status_code == 200, uploaded.text
        port = int(url.rsplit(":", 1)[1])
        stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", port))
        path = f"/v1/files/{uploaded.json()['id']}/content"
        stalled.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        time.sleep(1.5)  # the answer fills the buffers at once, then waits past the send timeout (0.5 s)
        received = 0
        stalled.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while chunk := stalled.recv(1 << 20):
                received += len(chunk)
        stalled.close()
        assert 0 < received < len(content) // 2, received
        # A slow reader is no stalled one: at ~2 MB/s the kernel's send buffer (megabytes)
        # wakes the writer only every second or so, but its queue keeps shrinking.
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        slow.settimeout(10)
        received = 0
        while received < 6_000_000:
            chunk = slow.recv(65536)
            assert chunk, f"cut after {received} bytes"
            received += len(chunk)
            time.sleep(0.03)
        slow.close()
        again = client.get(path)  # the server and the file are as they were
        assert again.status_code == 200 and len(again.content) == len(content)
        assert process.poll() is None


def test_a_request_head_past_the_bound_is_a_431_and_an_ambiguous_body_length_a_400() -> None:
    """Seventh probe of issue 45: ``--max-header-size`` bounded only a head still incomplete
    (h11's buffer), so 20 KB of headers in one read were taken and answered 200, and in
    pieces the connection was closed with uvicorn's plain 400. Both are a 431 in the API's
    error shape now, and a head under the bound is served."""

    def ask(port: int, header_bytes: int, pieces: int) -> bytes:
        head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {'a' * header_bytes}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            step = -(-len(head) // pieces)
            try:
                for start in range(0, len(head), step):
                    sock.sendall(head[start : start + step])
                    time.sleep(0.01 if pieces > 1 else 0)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the rest went out
            received = b""
            try:
                while chunk := sock.recv(65536):
                    received += chunk
                    if received.startswith(b"HTTP/1.1 200") and received.endswith(b"}"):
                        break
            except ConnectionResetError:
                pass
            return received

    with serving("--max-header-size", "16384") as (_, url):
        port = int(url.rsplit(":", 1)[1])
        assert ask(port, 10_000, 1).startswith(b"HTTP/1.1 200")
        for pieces in (1, 20):
            answer = ask(port, 20_000, pieces)
            assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), answer[:200]
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_header_fields_too_large" and "16384 bytes" in error["message"]
        # Tenth probe: both Transfer-Encoding and Content-Length were taken (h11 reads the
        # chunks); a proxy in front reading the length would take the rest for another
        # request (RFC 9112, 6.3: "ought to be handled as an error").
        body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
        smuggled = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(smuggled)
            answer = b""
            while chunk := sock.recv(65536):  # the server closes after its answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 Bad Request"), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "ambiguous_body_length" and "Transfer-Encoding and Content-Length" in error["message"]
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_request_that_is_not_http_gets_the_api_error_shape() -> None:
    """Thirteenth probe of issue 45: what h11 could not parse (a malformed request line, a
    header without a colon, a bad chunk size) got uvicorn's plain-text "Invalid HTTP request
    received."; it is a 400 in the API's error shape now, saying why, and then a close."""

    def ask(port: int, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(data)
            answer = b""
            while chunk := sock.recv(65536):  # the server closes after its answer
                answer += chunk
            return answer

    fine = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    cases = {
        "request line": b"GET /health\r\nHost: 127.0.0.1\r\n\r\n",
        "header": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
        "chunk": b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "second request": fine.replace(b"\r\n\r\n", b"\r\nConnection: keep-alive\r\n\r\n") + b"BAD\r\n\r\n",
    }
    with serving() as (_, url):
        port = int(url.rsplit(":", 1)[1])
        for what, data in cases.items():
            answer = ask(port, data)
            last = answer[answer.rfind(b"HTTP/1.1 ") :]  # the second request's answer after the first's
            assert last.startswith(b"HTTP/1.1 400 Bad Request"), (what, answer[:300])
            assert b"content-type: application/json" in last.lower(), (what, last[:300])
            error = json.loads(last.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "invalid_http_request", (what, error)
            assert error["message"].startswith("the request is not valid HTTP/1.1: "), (what, error)
            assert "bytearray(" not in error["message"], error  # h11 quotes its buffer's repr
        header = json.loads(ask(port, cases["header"]).split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert header.endswith("illegal header line: 'no colon here'"), header
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_request_target_in_absolute_form_is_served() -> None:
    """Fourteenth probe of issue 45: ``GET http://HOST/v1/models`` (absolute-form, which a
    server must accept: RFC 9112, 3.2.2) was a 404 "no route"; it is served as its path now,
    and an authority other than the Host header is a 400 saying so."""

    def ask(port: int, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(data)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer

    with serving() as (_, url):
        port = int(url.rsplit(":", 1)[1])
        host = f"127.0.0.1:{port}".encode()
        fine = ask(
            port,
            b"GET http://" + host + b"/v1/models?limit=1 HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n",
        )
        assert fine.startswith(b"HTTP/1.1 200"), fine[:300]
        listed = json.loads(fine.split(b"\r\n\r\n", 1)[1])
        assert listed["data"][0]["id"] == "tiny" and listed["has_more"] is False  # the query reached the route
        other = ask(port, b"GET http://evil.test/v1/models HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        assert other.startswith(b"HTTP/1.1 400"), other[:300]
        error = json.loads(other.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "host_mismatch" and "authority is not its Host header" in error["message"], error


def test_fd_limit_is_raised_to_the_hard_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 512:
        pytest.skip("needs a finite hard open-file limit of at least 512")
    with serving(preexec_fn=_fd_limit(256, hard)) as (process, _):
        limits = Path(f"/proc/{process.pid}/limits")
        if not limits.exists():
            pytest.skip("no /proc to read the server's limits from")
        line = next(x for x in limits.read_text().splitlines() if x.startswith("Max open files"))
        assert line.split()[3] == str(hard), line


@pytest.mark.parametrize("cap", ["default", "beyond the fd limit"])
def test_many_idle_connections_under_a_low_fd_limit(cap: str) -> None:
    """With 256 descriptors: connections over the cap are closed at once (default), or,
    with a cap the fd limit cannot honour, accept() fails with EMFILE, reported once per
    interval instead of a traceback per attempt. Either way /health answers."""
    args = ["--header-timeout", "1"] + (["--max-connections", "100000"] if cap != "default" else [])
    with ExitStack() as stack:
        process, url = stack.enter_context(serving(*args, preexec_fn=_fd_limit(256, 256)))
        port = int(url.rsplit(":", 1)[1])
        idle = _open_idle(port, 400)
        for sock in idle:
            stack.callback(sock.close)
        time.sleep(1.5)  # the server takes in what it can, and cuts those at the deadline
        start = time.monotonic()
        with httpx.Client(timeout=30) as client:
            assert client.get(f"{url}/health").status_code == 200
        answered_in = time.monotonic() - start
        assert process.poll() is None
        stderr = stopped_log(process)
    assert answered_in < 15
    assert "Traceback" not in stderr, stderr[:2000]
    lines = stderr.splitlines()
    assert len(lines) < 10, stderr[:2000]
    expected = "more than 192 open connections" if cap == "default" else "Too many open files"
    assert sum(expected in line for line in lines) == 1, stderr
