"""The child processes that make model folders (the GGUF converter, og's model builder):
run one, read what it says line by line, and name how it ended."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Mapping
from typing import IO, Any

__all__ = ["ended_by", "run_child"]


def run_child(
    command: list[str],
    on_line: Callable[[str], None],
    *,
    stderr: IO[Any] | int = subprocess.STDOUT,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``command``, hand each line of its standard output (without the newline) to
    ``on_line``, and return its exit status. The child is killed if ``on_line`` raises
    (a caller's progress callback) or this thread is interrupted: nothing builds on alone."""
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
    )
    assert child.stdout is not None
    try:
        for line in child.stdout:
            on_line(line.rstrip("\n"))
        return child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()


def ended_by(code: int) -> str | None:
    """How a child whose exit status is ``code`` was ended by a signal (``SIGSEGV``;
    ``SIGKILL (out of memory?)``), or ``None`` if it exited."""
    if code >= 0:
        return None
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return name + (" (out of memory?)" if -code == signal.SIGKILL else "")
