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
from typing import Any

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
def running(app: Any) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1:<free port>; yields ``http://127.0.0.1:PORT``."""
    import uvicorn  # here, so that model-only tests run without the server installed

    # IPPROTO_TCP named, as ortserve's own listen() does: asyncio turns Nagle off only on
    # sockets whose protocol reads TCP, and with Nagle on every request on a kept-alive
    # connection waited 40 ms for the client's delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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
