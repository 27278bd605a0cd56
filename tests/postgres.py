"""A real PostgreSQL server for the tests: Debian's package (``apt-get install postgresql``,
which ``.ci/run`` does), a fresh cluster in a temporary directory, started with ``pg_ctl``
on a free loopback port and stopped afterwards. Skips where PostgreSQL is not installed."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database (a cluster of its own)."""
    binaries = _bin()
    if binaries is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    as_root = os.geteuid() == 0  # initdb refuses root: run the server as Debian's postgres user
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    folder = Path(tempfile.mkdtemp(prefix="ortserve-pg-"))
    data = folder / "data"
    if as_root:
        shutil.chown(folder, "postgres")
    port = _free_port()

    def run(program: str, *args: str | Path) -> None:
        subprocess.run([*prefix, binaries / program, *args], check=True, capture_output=True, text=True)

    try:
        run("initdb", "-D", data, "-A", "trust", "-U", "postgres")
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        run("pg_ctl", "-D", data, "-o", options, "-w", "-l", folder / "log", "start")
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            run("pg_ctl", "-D", data, "-m", "immediate", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
