"""A real full disk for the tests: a tmpfs of a few MiB mounted in a mount namespace of
the command's own (``unshare --user --map-root-user --mount``, util-linux), so no root is
needed where the kernel lets users make namespaces. The mount is seen only by the command
and its children; it goes when they have all ended. Skips where it cannot be made."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

_MOUNT = 'mount -t tmpfs -o size="$1",mode=0777 tmpfs "$2" && shift 2 && exec "$@"'


def on_small_disk(folder: Path, size: int, command: list[str]) -> list[str]:
    """``command``, to run with a filesystem of ``size`` bytes mounted at ``folder`` (which
    must exist). It runs as root of its own user namespace: the files it makes belong to
    the user that started it."""
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "--"]
    return [*namespace, "sh", "-c", _MOUNT, "sh", str(size), str(folder), *command]


@functools.cache
def _why_not() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(on_small_disk(Path(folder), 65536, ["true"]), check=False, capture_output=True, text=True)
    return None if done.returncode == 0 else f"no tmpfs in a user namespace here: {done.stderr.strip()}"


def require_small_disks() -> None:
    """Skip the test where :func:`on_small_disk` cannot run (no user namespaces)."""
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
