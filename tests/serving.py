"""Run an ASGI app under a real uvicorn server on a loopback port, in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

TINY_MODEL = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen2"
LORA_MODEL = Path(__file__).resolve().parent / "fixtures" / "tiny-qwen2-lora"
"""The tiny Qwen2 with LoRA inputs; its adapters are ``LORA_MODEL / "adapters" / f"{name}.onnx_adapter"``."""
LORA_ADAPTERS = {name: LORA_MODEL / "adapters" / f"{name}.onnx_adapter" for name in ("alpha", "beta")}


async def refilled(model: Any) -> None:
    """Wait until an ort-cpu model's engine has put its finished replies into the prefix
    cache (it does so while idle; see the engine's ``_refill_step``)."""
    while model.engine.refilling:
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def running(app: Any, *, http: Any = "auto") -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1:<free port>; yields ``http://127.0.0.1:PORT``. ``http``:
    uvicorn's HTTP protocol (``ortserve serve`` uses its ``GuardedH11Protocol``; uvicorn's
    "auto" is httptools where it is installed)."""
    import uvicorn  # here, so that model-only tests run without the server installed

    # IPPROTO_TCP named, as ortserve's own listen() does: asyncio turns Nagle off only on
    # sockets whose protocol reads TCP, and with Nagle on every request on a kept-alive
    # connection waited 40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", http=http))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@contextlib.contextmanager
def serving_templates(folder: Path, templates: dict[str, str], **models: Path) -> Iterator[str]:
    """The tiny model served once per chat template of ``templates`` (under its name; each
    written to ``folder`` and given as the model's ``chat_template`` file), with ``models``
    as they are; yields the URL as :func:`running`."""
    from ortserve_runtime import ModelConfig
    from ortserve_server import ServerConfig, create_app

    configs = {}
    for name, source in templates.items():
        (folder / f"{name}.jinja").write_text(source)
        configs[name] = ModelConfig(chat_template=folder / f"{name}.jinja")
    config = ServerConfig(models={**dict.fromkeys(templates, TINY_MODEL), **models}, model_configs=configs)
    with running(create_app(config)) as url:
        yield url


@contextlib.contextmanager
def rss_growth() -> Iterator[list[int]]:
    """The peak growth of this process's resident memory, in bytes, while the block runs:
    ``with rss_growth() as grown: ...`` then ``grown[0]``. Sampled every 5 ms from
    /proc/self/statm (Linux), so that a spike freed before the block ends still counts."""
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * page

    start = resident()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], resident())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    grown = [0]
    try:
        yield grown
    finally:
        done.set()
        sampler.join()
        grown[0] = max(peak[0], resident()) - start


@contextlib.contextmanager
def serve(log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``ortserve serve`` on a free port, its stderr into ``log``; stopped with SIGTERM (an
    orderly shutdown: what is buffered is written) when the block ends."""
    with log.open("ab") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
        )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(timeout=10)
        process.stdout.close()
        raise AssertionError(f"server exited {process.returncode}: {log.read_text()}")
    try:
        yield f"http://127.0.0.1:{json.loads(line)['port']}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


class Watched:
    """What :func:`watched` saw: every ``/health`` answer's time, in seconds, and the
    process's peak resident growth, in bytes."""

    def __init__(self) -> None:
        self.health: list[float] = []
        self.grown = 0

    @property
    def slowest(self) -> float:
        return max(self.health, default=float("inf"))

    def assert_within(self, *, health: float = 0.1, grown: int = 512 * 2**20) -> None:
        """Issue 45's bounds: ``/health`` answered throughout, each time under ``health``
        seconds, and the process grew by less than ``grown`` bytes."""
        seen = f"/health at most {self.slowest * 1000:.0f} ms over {len(self.health)} polls; +{self.grown >> 20} MiB"
        print(seen)  # the figures, for -s
        assert self.health, "/health was never answered"
        assert self.slowest < health and self.grown < grown, seen


_POLLER: list[subprocess.Popen[str]] = []


def _poller() -> subprocess.Popen[str]:
    """The /health poller process (tests/health_poller.py), started once a test process."""
    if not _POLLER or _POLLER[0].poll() is not None:
        script = Path(__file__).resolve().parent / "health_poller.py"
        _POLLER[:] = [
            subprocess.Popen(
                [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
            )
        ]
    return _POLLER[0]


@contextlib.contextmanager
def watched(url: str, *, every: float = 0.02) -> Iterator[Watched]:
    """``GET {url}/health`` every ``every`` seconds from a process of its own (one
    kept-alive connection; see tests/health_poller.py for why not a thread) while the block
    runs, and this process's resident growth (the server runs in it; see :func:`running`):
    ``with watched(url) as seen: ...`` then ``seen.assert_within()``. A poll that fails or
    is not a 200 is recorded as infinitely slow, so it fails the bound."""
    poller = _poller()
    assert poller.stdin is not None and poller.stdout is not None
    seen = Watched()
    grown = [0]
    try:
        with rss_growth() as grown:
            poller.stdin.write(f"watch {url} {every}\n")
            assert poller.stdout.readline() == "ready\n", "the /health poller did not start"
            try:
                yield seen
            finally:
                poller.stdin.write("stop\n")
                times = json.loads(poller.stdout.readline())
                seen.health = [float("inf") if took is None else took for took in times]
    finally:  # also when the block raises (a test may expect it to)
        seen.grown = grown[0]


T = TypeVar("T")
_OPEN_CLIENTS: list[Any] = []


def closing(client: T) -> T:
    """An SDK client closed when the test ends (tests/server/conftest.py): left open, its
    pooled socket is reported unclosed by whichever later test's garbage collection finds it
    (a test that calls gc.collect failed for another's client in a CI run)."""
    _OPEN_CLIENTS.append(client)
    return client


def close_clients() -> None:
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close()
