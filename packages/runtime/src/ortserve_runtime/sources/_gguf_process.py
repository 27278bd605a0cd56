"""A GGUF file converted in a child process.

In the server's process the conversion held the server's GIL for seconds (a busy CI run
saw ``/health`` take 1.08 s while SmolLM2 converted), kept its peak memory there, and a
crash in numpy or onnx on a hostile file would have ended the server. :func:`convert_in_child`
runs :func:`._gguf.convert_gguf` in a child Python started by :data:`_BOOTSTRAP`, which
stubs the ``ortserve_runtime`` and ``ortserve_runtime.sources`` packages so that their
``__init__`` (every model kind and engine) does not run there: the child imports the
converter's few modules and nothing else.

The child speaks one line at a time on its standard output (its own prints and those of
the libraries it calls go to its standard error, kept in a file for a failure's reason):
``progress F`` as the conversion reads the weights, ``error MESSAGE`` (JSON) for a
:class:`GgufError`, which the parent raises again with the same message. A child ended by
a signal (a crash, the kernel's out-of-memory killer) is a :class:`GgufError` naming the
signal. The child exits when its parent does.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ._child import ended_by, run_child
from ._names import GgufError

__all__ = ["convert_in_child", "main"]

_BOOTSTRAP = """
import sys, types
for name, path in (("ortserve_runtime", sys.argv[1]), ("ortserve_runtime.sources", sys.argv[1] + "/sources")):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
from ortserve_runtime.sources._gguf_process import main
main(*sys.argv[2:])
"""
"""Starts the child without running the packages' ``__init__`` (0.5 s of imports saved)."""

_STEP = 0.002
"""The smallest change of the fraction the child reports (fewer lines on a big file)."""


def convert_in_child(source: Path, folder: Path, progress: Callable[[float], None] = lambda fraction: None) -> None:
    """Write the genai folder of the GGUF file ``source`` into ``folder`` (which exists)
    from a child process; ``GgufError`` with the converter's own message when it refuses
    the file, or naming how the child ended."""
    package = Path(__file__).resolve().parents[1]
    errors: list[str] = []
    full: list[str] = []
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:

        def on_line(line: str) -> None:
            word, _, rest = line.partition(" ")
            if word == "progress":
                progress(float(rest))
            elif word == "error":
                errors.append(json.loads(rest))
            elif word == "full":
                full.append(json.loads(rest))

        code = run_child(
            [sys.executable, "-c", _BOOTSTRAP, str(package), str(source), str(folder), str(os.getpid())],
            on_line,
            stderr=log,
        )
        log.seek(0)
        tail = collections.deque((line.strip() for line in log if line.strip()), maxlen=5)
    if full:
        # The disk, not the file: tried again once there is room (not remembered), and a 507.
        no_room = GgufError(full[-1])
        no_room.transient = True
        raise no_room from OSError(errno.ENOSPC, full[-1])
    if errors:
        raise GgufError(errors[-1])
    ended = ended_by(code)
    if ended is not None:
        killed = GgufError(f"converting {source.name} ended with {ended}: its converter crashed or was killed")
        killed.transient = True  # the memory it needed may be there next time: not remembered
        raise killed
    if code != 0 or not (folder / "genai_config.json").exists():
        said = tail[-1] if tail else f"it exited with status {code}"
        raise GgufError(f"{source.name} could not be converted: {said}")


def main(source: str, folder: str, parent: str) -> None:
    """The child: convert ``source`` into ``folder``, reporting on standard output, and
    exit if the process ``parent`` ends first."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints never reach the protocol

    def watch() -> None:  # end with the server rather than convert on alone
        while os.getppid() == int(parent):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    from ._gguf import convert_gguf  # the converter's imports: numpy, onnx, gguf-py

    reported = -1.0

    def report(fraction: float) -> None:
        nonlocal reported
        if fraction - reported >= _STEP or fraction >= 1.0:
            channel.write(f"progress {fraction:.4f}\n")
            reported = fraction

    try:
        convert_gguf(Path(source), Path(folder), report)
    except Exception as exc:  # noqa: BLE001 - anything the file provokes, named in the parent
        if isinstance(exc, GgufError):
            said, cause = str(exc), exc.__cause__
        else:
            traceback.print_exc()
            said, cause = f"{Path(source).name} could not be converted: {type(exc).__name__}: {exc}", exc
        # numpy's "Not enough free space to write ..." and "4096 requested and 3072 written"
        # are OSErrors without an errno: the disk's own room says.
        no_room = isinstance(cause, OSError) and (cause.errno in _DISK_FULL or _no_room(Path(folder)))
        channel.write(f"{'full' if no_room else 'error'} {json.dumps(said)}\n")
        sys.exit(1)


_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _no_room(folder: Path) -> bool:
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False
