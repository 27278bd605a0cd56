"""espeak-ng in a child process.

piper-tts's espeak-ng bridge is C, and espeak-ng crashes on some text that passes every
check (``"a." * 100``: SIGSEGV in a loop that walks a UTF-8 string backwards past its
start, sixteenth probe, issue 45). In the server's process that ended the server. A
:class:`Phonemizer` runs the bridge in a long-lived child Python instead, one per voice,
started at the voice's load by :data:`_BOOTSTRAP`, which stubs the ``ortserve_runtime``
and ``piper`` packages so that their ``__init__`` (every model kind; piper's onnxruntime
voice) does not run there: the child loads the bridge's shared library and nothing else.

The protocol is one JSON line each way on the child's standard input and output (its own
prints and espeak's go to its standard error): ``{"voice": V, "text": T}`` asks for the
clauses of ``T`` in voice ``V``, answered with ``{"clauses": [[phonemes, terminator,
end_of_sentence], ...]}`` (what ``get_phonemes`` returns) or ``{"error": MESSAGE}``.
A call is one pipe round trip (some 0.1 ms besides espeak's own time); calls take turns.

A child that dies during a call is started again and the text is tried once more on the
fresh one (the child may have died of something else, and espeak's crashes depend on
memory layout). Only a crash (``SIGSEGV``, ``SIGABRT``...) that repeats on the fresh child
is the text's fault: ``InvalidRequestError`` naming ``input``. A child that does not
answer within :data:`CALL_SECONDS` (hung, or stopped from outside), or that was ended from
outside (``SIGKILL``: the OOM killer, an operator) is the server's: it is killed, the next
call starts a fresh one, and the request fails with :class:`ModelCrashedError` (a 503 worth
retrying). The child exits when its parent does: its standard input closes, and it
watches the parent's pid in case another process holds the pipe open.

Calls take turns on a lock; a caller waits for it in its own thread, so the voice gives
each Phonemizer a single thread of its own (``VoiceModel``) rather than the event loop's
shared pool, which every other model's requests need (seventeenth probe, issue 45).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from .._errors import EngineClosedError, EngineError, InvalidRequestError, ModelCrashedError, ModelLoadError
from ..sources._child import ended_by

__all__ = ["Phonemizer", "main"]

_BOOTSTRAP = """
import sys, types
for name, path in (
    ("ortserve_runtime", sys.argv[1]),
    ("ortserve_runtime.sources", sys.argv[1] + "/sources"),
    ("ortserve_runtime.speech", sys.argv[1] + "/speech"),
    ("piper", sys.argv[2]),
):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from ortserve_runtime.speech._espeak import main
main(*sys.argv[3:])
"""
"""Starts the child without running the packages' ``__init__`` (0.5 s of imports, and the
memory of onnxruntime, saved)."""

CALL_SECONDS = 15.0
"""How long espeak may take on one text (4,096 characters take well under a second): a
child that takes longer is taken for hung (or stopped), killed and replaced, and the
request fails with :class:`ModelCrashedError`. Read at each call."""
_START_SECONDS = 60.0
_CRASHES = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGTRAP, signal.SIGSYS}
)
"""Signals of a crash inside espeak: a text's fault when it repeats on a fresh child. Any
other end (``SIGKILL``, ``SIGTERM``, an exit) came from outside the text."""


class _Died(Exception):
    """The child ended during a call; ``args[0]`` says how (``SIGSEGV``), ``crashed``
    whether by a crash signal (see :data:`_CRASHES`)."""

    def __init__(self, how: str, *, crashed: bool) -> None:
        super().__init__(how)
        self.crashed = crashed


class Phonemizer:
    """espeak-ng's clauses of a text, from a child process (see the module docstring).
    ``ModelLoadError`` when piper-tts (the ``voice`` extra) is not installed or its child
    does not start."""

    def __init__(self, folder: Path) -> None:
        try:
            from piper import espeakbridge  # type: ignore[import-not-found, unused-ignore]
            from piper.phonemize_espeak import ESPEAK_DATA_DIR  # type: ignore[import-not-found, unused-ignore]
        except ImportError as exc:
            raise ModelLoadError(
                f"{folder} is a Piper voice; speaking needs the espeak-ng phonemizer of piper-tts "
                f"(GPL-3.0-or-later): pip install 'ortserve-runtime[voice]' ({exc})",
                path=folder,
            ) from exc
        package = Path(__file__).resolve().parents[1]
        piper = Path(espeakbridge.__file__).parent
        self._command = [sys.executable, "-c", _BOOTSTRAP, str(package), str(piper), str(ESPEAK_DATA_DIR)]
        self._lock = threading.Lock()
        self._closed = False
        self._buffer = bytearray()
        # The running child, in a list that a finalizer shares: a Phonemizer dropped
        # without close() leaves no child behind.
        self._held: list[subprocess.Popen[bytes]] = []
        self._selector: selectors.BaseSelector | None = None
        weakref.finalize(self, _kill, self._held)
        try:
            with self._lock:
                self._start()
        except EngineError as exc:
            raise ModelLoadError(f"{folder}: {exc}", path=folder) from exc

    @property
    def pid(self) -> int | None:
        """The child's process id (``None`` between a death and the next call)."""
        return self._held[0].pid if self._held else None

    def clauses(self, voice: str, text: str) -> list[tuple[str, str, bool]]:
        """``get_phonemes(text)`` in espeak voice ``voice``: ``(phonemes, terminator,
        end_of_sentence)`` per clause. ``InvalidRequestError`` naming ``input`` when espeak
        crashes on ``text`` (twice) or fails on it; ``ModelCrashedError`` when its child
        hangs (past :data:`CALL_SECONDS`) or is ended from outside (see the module
        docstring)."""
        request = (json.dumps({"voice": voice, "text": text}) + "\n").encode("ascii")
        deaths: list[_Died] = []
        with self._lock:
            for _ in range(2):
                if self._closed:
                    raise EngineClosedError("the voice's phonemizer is closed")
                if not self._held or self._held[0].poll() is not None:
                    self._stop()
                    self._start()
                try:
                    reply = self._ask(request)
                except _Died as died:
                    deaths.append(died)
                    self._stop()
                    continue
                except ModelCrashedError:
                    self._stop()
                    raise
                if "error" in reply:
                    raise InvalidRequestError(f"input could not be phonemized: {reply['error']}", param="input")
                return [(str(p), str(t), bool(end)) for p, t, end in reply["clauses"]]
        if self._closed:
            raise EngineClosedError("the voice's phonemizer is closed")
        if all(died.crashed for died in deaths):
            raise InvalidRequestError(
                f"input could not be phonemized: espeak-ng crashed on it ({deaths[-1]})", param="input"
            )
        raise ModelCrashedError(
            f"espeak-ng's process ended during the call ({', then '.join(map(str, deaths))}), not by a crash on "
            "the input; it is started again at the next request: try again"
        )

    def close(self) -> None:
        """End the child; later calls raise ``EngineClosedError``."""
        self._closed = True
        _kill(self._held)  # a call in flight sees its child end and returns
        with self._lock:
            self._stop()

    # -- the child, seen from here ---------------------------------------------------------

    def _start(self) -> None:
        child = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._held.append(child)
        self._buffer.clear()
        assert child.stdout is not None
        self._selector = selectors.DefaultSelector()  # not select(): a server's fds pass 1,024
        self._selector.register(child.stdout, selectors.EVENT_READ)
        try:
            ready = self._line(_START_SECONDS)
        except _Died as died:
            self._stop()
            raise EngineError(f"espeak-ng's process ended as it started ({died})") from None
        if ready != {"ready": True}:
            self._stop()
            raise EngineError(f"espeak-ng's process did not start: {ready}")

    def _ask(self, request: bytes) -> dict[str, Any]:
        child = self._held[0]
        assert child.stdin is not None
        try:
            child.stdin.write(request)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(child) from None
        return self._line(CALL_SECONDS)

    def _line(self, seconds: float) -> dict[str, Any]:
        """The child's next line, parsed; ``_Died`` when it ends first, ``ModelCrashedError``
        when it takes longer than ``seconds`` (then it is killed)."""
        deadline = time.monotonic() + seconds
        child, selector = self._held[0], self._selector
        assert child.stdout is not None and selector is not None
        while (end := self._buffer.find(b"\n")) < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                child.kill()
                child.wait()
                raise ModelCrashedError(
                    f"espeak-ng's process did not answer within {seconds:g} s (hung, or stopped from "
                    "outside); it was killed and is started again at the next request: try again"
                )
            if not selector.select(left):
                continue
            data = os.read(child.stdout.fileno(), 1 << 16)
            if not data:
                raise self._died(child)
            self._buffer += data
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        reply: dict[str, Any] = json.loads(line)
        return reply

    @staticmethod
    def _died(child: subprocess.Popen[bytes]) -> _Died:
        code = child.wait()
        return _Died(ended_by(code) or f"exit status {code}", crashed=code < 0 and -code in _CRASHES)

    def _stop(self) -> None:
        """Reap the child (killed if it still runs) and close its pipes."""
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        _kill(self._held)
        while self._held:
            child = self._held.pop()
            child.wait()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()


def _kill(held: list[subprocess.Popen[bytes]]) -> None:
    for child in held:
        if child.poll() is None:
            child.kill()


def main(data_dir: str) -> None:
    """The child: answer requests on standard input until it closes or the parent ends."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="ascii")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints never reach the protocol
    parent = os.getppid()

    def watch() -> None:  # end with the server even if another process holds our stdin open
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    try:  # a crash is expected now and then (hostile text): no core file for each
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    from piper import espeakbridge  # type: ignore[import-not-found, unused-ignore]

    espeakbridge.initialize(data_dir)
    channel.write('{"ready": true}\n')
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            espeakbridge.set_voice(request["voice"])
            reply: dict[str, Any] = {"clauses": espeakbridge.get_phonemes(request["text"])}
        except Exception as exc:  # noqa: BLE001 - the text's failure (a lone surrogate), named in the parent
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        channel.write(json.dumps(reply) + "\n")
