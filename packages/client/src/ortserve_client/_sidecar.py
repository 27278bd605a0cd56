"""A managed local ortserve server: attach to one that is running, or spawn and own one.

Spawning starts ``python -m ortserve_server serve`` in a new process group with this
process's pid in its environment (the server exits by itself if this process dies),
waits for its JSON ready line and a healthy ``/health``, and on ``stop()`` sends SIGTERM
to the group, waits, then SIGKILL. An ``atexit`` hook stops what is still running. A lock
file per port makes two hosts that start at once end with one server: the second waits
for the first and attaches.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import hmac
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import httpx

from ._client import AsyncClient
from ._download import DownloadEvent, apull
from ._errors import PortInUseError, ServerExited, ServerLifecycleError, ServerStartupTimeout
from ._reference import HubReference
from .protocol import Model

__all__ = [
    "Attached",
    "Converting",
    "Exited",
    "LocalServer",
    "LogLine",
    "Ready",
    "Restarting",
    "ServerEvent",
    "Spawned",
]

PARENT_PID_ENV = "ORTSERVE_PARENT_PID"
LOCK_DIR = Path(os.environ.get("ORTSERVE_CACHE", Path.home() / ".cache" / "ortserve")) / "locks"


@dataclass(frozen=True, slots=True)
class Spawned:
    pid: int
    command: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ready:
    base_url: str
    pid: int


@dataclass(frozen=True, slots=True)
class Attached:
    """An ortserve server was already answering; it is used, not owned."""

    base_url: str


@dataclass(frozen=True, slots=True)
class Converting:
    """The server, before it is ready, converts model ``model``'s source (a GGUF file, a
    checkpoint's build): ``progress`` from 0 to 1. Each one also moves the start-up
    deadline: ``startup_timeout`` bounds the time without progress, not a conversion."""

    model: str
    progress: float


@dataclass(frozen=True, slots=True)
class LogLine:
    stream: Literal["stdout", "stderr"]
    line: str


@dataclass(frozen=True, slots=True)
class Exited:
    """The spawned server's process ended: at :meth:`LocalServer.stop`, or on its own (a
    crash, a kill), which is reported when it happens."""

    returncode: int | None


@dataclass(frozen=True, slots=True)
class Restarting:
    """``restart="on-failure"``: the server died and is started again after ``delay`` seconds."""

    attempt: int
    delay: float


ServerEvent = DownloadEvent | Spawned | Converting | Ready | Attached | LogLine | Exited | Restarting


_PROOF_CHALLENGE = "x-ortserve-challenge"
_PROOF = "x-ortserve-proof"
"""The server's answer to a nonce: HMAC-SHA256 under the API key (see ``_try_attach``)."""


class LocalServer:
    """Attach to or spawn an ortserve server; ``async with`` or ``start()``/``stop()``.

    ``models`` maps names to model folders, GGUF files, transformers checkpoints or ``hf:``
    references, which are downloaded first (progress goes to ``on_event``; a GGUF file or a
    checkpoint is then converted before the server is ready, reported as
    :class:`Converting`, and ``startup_timeout`` counts from the last progress):
    ``hf:OWNER/REPO[/SUBFOLDER]`` for a
    folder, ``hf:OWNER/REPO[/SUBFOLDER]/FILE.gguf`` for that one file (every part of a
    split one); see :class:`HubReference`. ``port=0`` always spawns on a free port.
    ``lazy=True`` starts a spawned server with its models configured but not loaded (each
    loads on first use, or :meth:`load`); ``chat_templates`` gives models
    a Jinja chat template file to use instead of their own (``--model-option
    NAME:chat-template=FILE``: a model whose template knows no tools); ``serve_args`` are
    further ``ortserve serve`` flags (``["--idle-unload", "300", "--max-loaded-models", "2"]``).
    ``state_dir``: where a spawned server keeps stored Responses, adapters, files and batches
    across restarts (``"none"``: in its memory; ``None``: the server's default, the user's
    state directory), so that an app keeps its own state apart from other apps' servers.

    A spawned server is watched: if it dies on its own, :class:`Exited` is reported at once,
    and with ``restart="on-failure"`` it is started again on the same port after a backoff
    (0.5 s, doubling up to 10 s; at most ``max_restarts`` times in a row before one stays
    up for a minute), with :class:`Restarting` then :class:`Spawned`/:class:`Ready`.
    """

    def __init__(
        self,
        models: Mapping[str, str | Path] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 120.0,
        stop_timeout: float = 10.0,
        on_event: Callable[[ServerEvent], None] | None = None,
        log_lines: int = 200,
        lazy: bool = False,
        serve_args: Sequence[str] = (),
        chat_templates: Mapping[str, str | Path] | None = None,
        restart: Literal["no", "on-failure"] = "no",
        max_restarts: int = 5,
        state_dir: str | Path | None = None,
    ) -> None:
        self.models = dict(models or {})
        for source in self.models.values():
            HubReference.parse(source)  # a malformed hf: reference is a ValueError now, not at start
        self.state_dir = "none" if state_dir == "none" else state_dir and Path(state_dir).expanduser().resolve()
        self.host = host
        self.port = port
        self.api_key = api_key
        self.command = list(command) if command else [sys.executable, "-m", "ortserve_server"]
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self._deadline = 0.0
        """When start-up gives up: ``startup_timeout`` after the spawn or the last progress."""
        self.stop_timeout = stop_timeout
        self.on_event = on_event
        self.log: collections.deque[str] = collections.deque(maxlen=log_lines)
        self.lazy = lazy
        self.serve_args = list(serve_args)
        self.chat_templates = {name: Path(path).expanduser().resolve() for name, path in (chat_templates or {}).items()}
        unknown = sorted(set(self.chat_templates) - set(self.models))
        if unknown:
            raise ValueError(f"chat_templates names models that are not served: {', '.join(unknown)}")
        if restart not in ("no", "on-failure"):
            raise ValueError(f"restart must be 'no' or 'on-failure', not {restart!r}")
        self.restart = restart
        self.max_restarts = max_restarts
        self.owned = False
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False
        self._folders: dict[str, Path] = {}
        self.process: asyncio.subprocess.Process | None = None
        self._readers: list[asyncio.Task[None]] = []
        self._atexit: Callable[[], None] | None = None

    # -- public API ------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://host:port/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def client(self, **kwargs: Any) -> AsyncClient:
        """An :class:`AsyncClient` for this server (the caller closes it)."""
        return AsyncClient(self.base_url, api_key=self.api_key, **kwargs)

    async def status(self) -> list[Model]:
        """The server's models with their status (loaded or not, memory, requests in flight)."""
        async with self.client() as client:
            return (await client.models.list()).data

    async def load(self, model: str, *, keep_alive: float | str | None = None) -> Model:
        """Load a configured model now (see :meth:`AsyncClient.models.load <AsyncClient>`)."""
        async with self.client() as client:
            return await client.models.load(model, keep_alive=keep_alive)

    async def unload(self, model: str) -> Model:
        """Unload a model once its requests end (see :meth:`AsyncClient.models.unload <AsyncClient>`)."""
        async with self.client() as client:
            return await client.models.unload(model)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Attach to a healthy ortserve server on the port, or spawn one and wait for it."""
        self._stopping = False
        if self.port == 0:
            await self._spawn()
            return
        async with _PortLock(self.port):
            if await self._try_attach():
                return
            await self._spawn()

    async def stop(self) -> None:
        """Stop the server if this object spawned it: SIGTERM to its group, then SIGKILL."""
        self._stopping = True
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        process = self.process
        if process is None or not self.owned:
            return
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.stop_timeout)
            except TimeoutError:
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
        for reader in self._readers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader, 5)
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        self._emit(Exited(process.returncode))
        self.process = None

    # -- attach ----------------------------------------------------------------------------

    async def _try_attach(self) -> bool:
        """True if an ortserve server with our models answers; raises if a stranger does.

        With an API key, the server must first prove it holds the key (HMAC of a fresh
        nonce, answered on ``/health``): otherwise anything answering /health in the right
        shape would be sent the key and the prompts."""
        url = f"http://{self.host}:{self.port}/health"
        nonce = secrets.token_hex(16)
        try:
            async with httpx.AsyncClient(timeout=2.0) as http:
                response = await http.get(url, headers={_PROOF_CHALLENGE: nonce})
        except httpx.ConnectError:
            return False  # nothing listening: ours to spawn
        except httpx.HTTPError as exc:
            raise PortInUseError(self._stranger(f"does not speak HTTP ({type(exc).__name__})")) from exc
        try:
            health = response.json()
            served = {m["id"] for m in health["models"]}
            assert isinstance(health["status"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise PortInUseError(self._stranger(f"answers /health with HTTP {response.status_code}")) from None
        if self.api_key:
            expected = hmac.new(self.api_key.encode(), nonce.encode(), "sha256").hexdigest()
            proofs = response.headers.get(_PROOF, "").split(",")  # one per key the server accepts
            if not any(hmac.compare_digest(proof.strip(), expected) for proof in proofs):
                raise PortInUseError(
                    self._stranger(
                        "answers /health like ortserve but cannot prove it holds this API key (the key and "
                        "prompts were not sent)"
                    )
                )
        missing = sorted(set(self.models) - served)
        if missing:
            raise ServerLifecycleError(
                f"the ortserve server at {self.host}:{self.port} does not serve {missing} "
                f"(it serves {sorted(served)}); stop it or use another port"
            )
        self.owned = False
        self._emit(Attached(self.base_url))
        return True

    def _stranger(self, how: str) -> str:
        owner = _port_owner(self.port)
        who = f" (process {owner[0]}: {owner[1]})" if owner else ""
        return f"port {self.port} on {self.host} is held by something that is not ortserve{who}: it {how}"

    # -- spawn -----------------------------------------------------------------------------

    async def _spawn(self) -> None:
        self._folders = {name: await self._resolve(source) for name, source in self.models.items()}
        await self._start_process()
        assert self.process is not None
        self._watcher = asyncio.create_task(self._watch(self.process))

    def _stop_requested(self) -> bool:
        return self._stopping

    async def _start_process(self, *, give_up: bool = True) -> None:
        """Start the server process and wait until it is healthy; on failure it is killed,
        and (``give_up``) this object stopped."""
        folders = self._folders
        args = [*self.command, "serve", "--host", self.host, "--port", str(self.port), "--ready-json"]
        for name, folder in folders.items():
            args += ["--model", f"{name}={folder}"]
        for name, template in self.chat_templates.items():
            args += ["--model-option", f"{name}:chat-template={template}"]
        args += [*(["--lazy"] if self.lazy else []), *self.serve_args]
        if self.state_dir is not None:
            args += ["--state-dir", str(self.state_dir)]
        env = {**os.environ, **self.env, PARENT_PID_ENV: str(os.getpid())}
        if self.api_key:
            env["ORTSERVE_API_KEY"] = self.api_key  # not in argv, where `ps` would show it
        self.process = await asyncio.create_subprocess_exec(
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.owned = True
        pid = self.process.pid
        self._atexit = lambda: _kill_at_exit(pid)
        atexit.register(self._atexit)
        self._emit(Spawned(pid, tuple(args)))
        ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        assert self.process.stdout is not None and self.process.stderr is not None
        self._readers = [
            asyncio.create_task(self._read(self.process.stdout, "stdout", ready)),
            asyncio.create_task(self._read(self.process.stderr, "stderr", None)),
        ]
        self._deadline = time.monotonic() + self.startup_timeout
        try:
            line = await self._until(ready)
            self.port = int(line["port"])
            await self._wait_healthy(self._deadline)
        except BaseException:
            if give_up:
                await self._abandon()
            elif self.process.returncode is None:
                _signal_group(self.process.pid, signal.SIGKILL)
                await self.process.wait()
            raise
        self._emit(Ready(self.base_url, pid))

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        """Report the spawned server's death when it happens, and restart it if asked."""
        restarts, up_since = 0, time.monotonic()
        while True:
            await process.wait()
            if self._stopping:
                return
            await asyncio.gather(*self._readers, return_exceptions=True)
            self._emit(Exited(process.returncode))
            if self.restart != "on-failure" or process.returncode == 0:
                self.process = None
                return
            if time.monotonic() - up_since > 60:
                restarts = 0  # it had stayed up: a new run of failures
            if restarts >= self.max_restarts:
                self.process = None
                return
            restarts += 1
            delay = min(10.0, 0.5 * 2 ** (restarts - 1))
            self._emit(Restarting(restarts, delay))
            await asyncio.sleep(delay)
            if self._stop_requested():
                return
            try:
                await self._start_process(give_up=False)
            except ServerLifecycleError:
                continue  # its log went to on_event; the next attempt backs off further
            assert self.process is not None
            process, up_since = self.process, time.monotonic()

    async def _resolve(self, source: str | Path) -> Path:
        """A local path as given, or an ``hf:`` reference downloaded (see :class:`HubReference`)."""
        reference = HubReference.parse(source)
        if reference is None:
            return Path(source)
        folder = await apull(
            reference.repo_id,
            subfolder=reference.subfolder,
            allow_patterns=reference.allow_patterns,
            on_progress=self.on_event,
        )
        return reference.local_path(folder)

    async def _read(
        self, stream: asyncio.StreamReader, name: Literal["stdout", "stderr"], ready: asyncio.Future[Any] | None
    ) -> None:
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            if ready is not None and not ready.done() and line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == "ready":
                        ready.set_result(event)
                        continue
                    if event.get("event") == "converting":
                        self._deadline = time.monotonic() + self.startup_timeout  # it is not stuck
                        self._emit(Converting(str(event.get("model")), float(event.get("progress", 0.0))))
                        continue
            self.log.append(line)
            self._emit(LogLine(name, line))

    async def _until(self, ready: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
        """The ready line, by ``self._deadline`` (which conversion progress moves)."""
        assert self.process is not None
        exited: asyncio.Future[Any] = asyncio.ensure_future(self.process.wait())
        try:
            done: set[asyncio.Future[Any]] = set()
            while not done and time.monotonic() < self._deadline:
                done, _ = await asyncio.wait(
                    [ready, exited],
                    timeout=max(0.0, self._deadline - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
        finally:
            if not exited.done():
                exited.cancel()
        if ready in done:
            return ready.result()
        if exited in done:
            await asyncio.gather(*self._readers, return_exceptions=True)
            error: ServerLifecycleError = ServerExited(
                f"the ortserve server exited with code {self.process.returncode} before it was ready",
                returncode=self.process.returncode,
            )
        else:
            error = ServerStartupTimeout(f"the ortserve server was not ready within {self.startup_timeout:g} s")
        error.add_note("server log (last lines):\n" + "\n".join(self.log))
        raise error

    async def _wait_healthy(self, deadline: float) -> None:
        url = f"http://{self.host}:{self.port}/health"
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(url)).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    error = ServerStartupTimeout(f"{url} did not report healthy within {self.startup_timeout:g} s")
                    error.add_note("server log (last lines):\n" + "\n".join(self.log))
                    raise error
                await asyncio.sleep(0.05)

    async def _abandon(self) -> None:
        """A failed start leaves nothing behind."""
        if self.process is not None and self.process.returncode is None:
            _signal_group(self.process.pid, signal.SIGKILL)
            await self.process.wait()
        await self.stop()

    def _emit(self, event: ServerEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)


class _PortLock:
    """An exclusive lock file per port, held while attaching or spawning (POSIX only)."""

    def __init__(self, port: int) -> None:
        self.path = LOCK_DIR / f"port-{port}.lock"
        self.handle: Any = None

    async def __aenter__(self) -> None:
        if os.name != "posix":
            return
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = self.path.open("a")
        await asyncio.to_thread(fcntl.flock, self.handle, fcntl.LOCK_EX)

    async def __aexit__(self, *_: object) -> None:
        if self.handle is not None:
            self.handle.close()  # closing releases the lock
            self.handle = None


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(pid), signum)


def _kill_at_exit(pid: int) -> None:
    """The atexit backstop: SIGTERM the group, give it a moment, then SIGKILL."""
    _signal_group(pid, signal.SIGTERM)
    for _ in range(50):
        try:
            finished, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if finished:
            return
        time.sleep(0.1)
    _signal_group(pid, signal.SIGKILL)


def _port_owner(port: int) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on ``port``, on Linux; else None."""
    try:
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as handle:
                for row in handle.readlines()[1:]:
                    fields = row.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                        inodes.add(fields[9])
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in (entry / "fd").iterdir():
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        return int(entry.name), cmdline.strip()
    except OSError:
        return None
    return None
