"""onnxruntime-genai in a process of its own, for the ``og-generator`` engine.

``og.Generator``'s calls hold the GIL while they run (``set_inputs`` with an image,
``append_tokens`` with a long prompt, the multimodal processor): in the server's process
one 3,900-token prompt stopped every route for 0.84 s and eight 25-megapixel images for
6.3 s. In a child process they hold only the child's GIL, and a crash inside og ends
that model's requests with an error rather than the server.

:class:`OgProcess` is the parent's side: it starts
``ortserve_runtime._og_child`` (see :data:`_BOOTSTRAP`), which connects back over
loopback once per *lane* (``step``, ``prefill``, ``media``; each connection opens with a
token the child got in its environment), so the engine's owner thread, its prefill thread and the chat
front's media preparation each talk to a thread of their own in the child and go on side
by side as they did in one process. A call is one pickled message (media files follow it
as they are, pickle's out-of-band buffers) and its answer; logits come back as a NumPy
array (one copy of vocabulary-sized floats, tens of microseconds, against a decode step of
milliseconds). The child holds the ``og.Model``, the generators by
request id and the processed media by id; the parent names what to drop with its next call.
The child exits when the parent closes the lanes or dies (they read end-of-file).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from ._config import ModelConfig
from ._errors import EngineError, InvalidRequestError, ModelCrashedError, ModelLoadError

__all__ = ["LANES", "OgProcess", "RemoteMedia"]

LANES = ("step", "prefill", "media")
"""One per parent thread that calls og: the owner thread's decode steps (and adapters),
the prefill thread's new generators, and the chat front's media processing."""


TOKEN_VARIABLE = "ORTSERVE_OG_TOKEN"
"""The environment variable that hands the child the token its lanes open with."""
START_TIMEOUT = 120.0
"""Seconds the child may take to start and connect its lanes."""

WEDGED_SECONDS = 60.0
"""A child that answers nothing and uses no CPU time this long while a call waits on it is
wedged (stopped by a signal, deadlocked in native code): it is killed, so that call and the
model's next ones fail as a crash, the one after loads it again. Before, a stopped child
held every request of its model without end while /health said "ready" (fourteenth probe
of issue 45)."""

_BOOTSTRAP = """
import sys, types
package = sys.argv[1]
module = types.ModuleType("ortserve_runtime")
module.__path__ = [package]
sys.modules["ortserve_runtime"] = module
from ortserve_runtime._og_child import main
main(sys.argv[2], int(sys.argv[3]))
"""
"""Starts the child without running the package's ``__init__`` (it imports every model
kind and engine: 0.96 s, against the child's own few modules)."""


class RemoteMedia:
    """A multimodal prompt's processed inputs, held in the child under ``key``; dropped
    there once this object is gone (a prompt may be generated from more than once)."""

    __slots__ = ("__weakref__", "_room", "key")

    def __init__(self, process: OgProcess, key: int, room: threading.Semaphore | None = None) -> None:
        self.key = key
        self._room = [] if room is None else [room]
        weakref.finalize(self, _drop_media, process, key, self._room)

    def give_back_room(self) -> None:
        """Give back the ``room`` the inputs were made in (once; else when this object is
        gone): the engine does when a request of them ends, as its owner thread may hold
        its last requests until it wakes again."""
        _give_back(self._room)


def _give_back(room: list[threading.Semaphore]) -> None:
    with contextlib.suppress(IndexError):  # given back already
        room.pop().release()


def _drop_media(process: OgProcess, key: int, room: list[threading.Semaphore]) -> None:
    process.forget_media(key)
    _give_back(room)


class OgProcess:
    """The parent's side of one model's og process (see the module docstring)."""

    def __init__(self, folder: Path, config: ModelConfig, *, every_core: bool = True) -> None:
        self.folder = folder
        self._wedged = False
        self._loaded = False  # a load may wait on the disk without CPU time: never taken for wedged
        package = Path(__file__).resolve().parent
        token = secrets.token_hex(16)
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(0.2)
            host, port = server.getsockname()[:2]
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(package), host, str(port)],
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_VARIABLE: token},
            )
            self._lanes = {name: self._accept(server, token) for name in LANES}
        self._locks = {name: threading.Lock() for name in LANES}
        self._forgotten: list[tuple[str, int]] = []
        """Media and generators to drop in the child, sent with the next call."""
        self._forgetting = threading.RLock()
        """Guards ``_forgotten``: reentrant, as a finalizer may run on a thread holding it."""
        try:
            self.call("step", "load", str(folder), config, every_core)
            self._loaded = True
        except EngineError as exc:
            self.close()
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{folder} could not be loaded: {exc}", path=folder) from exc
        except BaseException:
            self.close()
            raise

    def _accept(self, server: socket.socket, token: str) -> Connection:
        """The child's next lane: a loopback connection that opens with ``token`` (another
        local process that connects is dropped); a child that ends first is a load error."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                sock, _ = server.accept()
            except TimeoutError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self._process.kill()
                    self._process.wait()
                    raise ModelLoadError(f"{self.folder}: {self._death()}", path=self.folder) from None
                continue
            sock.settimeout(None)
            # A message goes as its length, then its bytes (two writes past 16 KiB): Nagle's
            # algorithm held the second until the first was acknowledged, which the peer
            # delays up to 40 ms. Every og-generator step waited so (22.7 tokens/s on the
            # tiny vision models, whose steps take microseconds).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = Connection(sock.detach())
            if connection.poll(5) and hmac.compare_digest(connection.recv_bytes(64), token.encode()):
                return connection
            connection.close()

    @property
    def pid(self) -> int:
        return self._process.pid

    def call(self, lane: str, op: str, *args: Any) -> Any:
        """Run ``op`` in the child on ``lane`` and return its answer; what the child raised
        comes back as :class:`InvalidRequestError`, :class:`ModelLoadError` or
        ``RuntimeError`` with og's message; a child that ended is a :class:`ModelCrashedError`."""
        with self._forgetting:
            forgotten, self._forgotten = self._forgotten, []
        connection = self._lanes[lane]
        with self._locks[lane]:
            try:
                large: list[pickle.PickleBuffer] = []
                message = pickle.dumps((forgotten, op, args), protocol=5, buffer_callback=large.append)
                connection.send_bytes(message)
                for buffer in large:  # after the message, as they are (see _og_child._received)
                    connection.send_bytes(buffer.raw())
                self._await_answer(connection)
                status, value = pickle.loads(connection.recv_bytes())
                if status == "array":  # an array's bytes follow, unpickled (see _og_child._serve)
                    dtype, shape = value
                    array = np.empty(shape, dtype=dtype)  # writable: samplers mask logits in place
                    connection.recv_bytes_into(array.data.cast("B"))
                    return array
            except (EOFError, OSError) as exc:
                raise ModelCrashedError(self._death()) from exc
        if status == "ok":
            return value
        kind, message = value
        if kind == "invalid":
            text, param = message
            raise InvalidRequestError(text, param=param)
        if kind == "load":
            raise ModelLoadError(message, path=self.folder)
        if kind == "value":
            raise ValueError(message)
        raise RuntimeError(message)

    def _await_answer(self, connection: Connection) -> None:
        """Wait for the child's answer on ``connection``; kill a wedged child (see
        ``WEDGED_SECONDS``), whose lane then reads its end."""
        used, since = self._cpu_ticks(), time.monotonic()
        while not connection.poll(min(1.0, WEDGED_SECONDS)):
            if not self._loaded:
                continue
            now = self._cpu_ticks()
            if now is None:
                return  # gone: reading says so
            if now != used:
                used, since = now, time.monotonic()
            elif time.monotonic() - since >= WEDGED_SECONDS:
                self._wedged = True
                self._process.kill()
                return

    def _cpu_ticks(self) -> float | None:
        """The child's user and system CPU time in clock ticks, ``None`` once it is gone.
        Where /proc cannot say (not Linux), a value that always changes: never wedged."""
        try:
            with open(f"/proc/{self._process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None if self._process.poll() is not None else time.monotonic()
        return int(fields[11]) + int(fields[12])

    def process(
        self,
        text: str,
        images: Sequence[tuple[str, bytes]],
        audios: Sequence[tuple[str, bytes]],
        model_type: str,
        *,
        max_image_pixels: int = 0,
        lane: str = "media",
        param: str = "messages",
        room: threading.Semaphore | None = None,
    ) -> tuple[list[int], RemoteMedia]:
        """og's multimodal processor on a rendered chat and its media: the prompt's ids
        (none for Whisper), and its inputs as the child keeps them. ``images`` and
        ``audios``: each one's field and its bytes as the client sent them, decoded in the
        child (``_images``, at most ``max_image_pixels``; a chat's audio as ``_audio``
        reads it, a Whisper window as it is); what cannot be decoded or processed is an
        :class:`InvalidRequestError` naming its field (``param`` for the processor).
        ``room``, acquired by the caller, is given back with the inputs."""
        # Out of the pickle: pickling copied each file into the message holding the GIL (two
        # 12-megapixel images, 74 MB as the PNGs they become: 88 ms of the event loop's turns).
        files = [[pickle.PickleBuffer(data) for _, data in media] for media in (images, audios)]
        fields = [[field for field, _ in media] for media in (images, audios)]
        ids, key = self.call(lane, "process", text, *files, *fields, max_image_pixels, model_type, param)
        return ids, RemoteMedia(self, key, room)

    def forget_media(self, key: int) -> None:
        with self._forgetting:
            self._forgotten.append(("media", key))

    def forget_generator(self, key: int) -> None:
        with self._forgetting:
            self._forgotten.append(("generator", key))

    def resident_bytes(self) -> int:
        """The child's resident set size (Linux; 0 elsewhere)."""
        try:
            with open(f"/proc/{self._process.pid}/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    @property
    def failure(self) -> str | None:
        """Why the child is gone, once it is (``None`` while it runs)."""
        return self._death() if self._process.poll() is not None else None

    def _death(self) -> str:
        try:
            code = self._process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exit status {code}" if code is not None and code >= 0 else f"signal {-(code or 0)}"
        if self._wedged:
            how = f"killed: no answer and no CPU time for {WEDGED_SECONDS:g} s, stopped or deadlocked"
        return f"the onnxruntime-genai process of this model ended ({how}); the next request loads it again"

    def close(self) -> None:
        """Close the lanes (the child exits on reading their end) and reap the child."""
        for connection in self._lanes.values():
            connection.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
