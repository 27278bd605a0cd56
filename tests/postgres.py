"""A real PostgreSQL server for the tests: Debian's package (``apt-get install postgresql``,
which ``.ci/run`` does), a fresh cluster in a temporary directory, started with ``pg_ctl``
on a free loopback port and stopped afterwards. Skips where PostgreSQL is not installed."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
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
def postgres_server(*, small_tablespace: int | None = None) -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database (a cluster of its own).

    ``small_tablespace``: the database's tables go in a tablespace on a filesystem of that
    many bytes (a tmpfs only the cluster sees; see :mod:`small_disk`), so that filling it
    is PostgreSQL's own disk_full (53100). Write-ahead log and catalogs stay on the real disk."""
    binaries = _bin()
    if binaries is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="ortserve-pg-"))
    data = folder / "data"
    small = folder / "small"
    prefix, start_prefix = _prefixes(folder, small, small_tablespace)
    port = _free_port()

    def run(program: str, *args: str | Path, first: list[str] = prefix) -> None:
        subprocess.run([*first, binaries / program, *args], check=True, capture_output=True, text=True)

    try:
        run("initdb", "-D", data, "-A", "trust", "-U", "postgres")
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        run("pg_ctl", "-D", data, "-o", options, "-w", "-l", folder / "log", "start", first=start_prefix)
        try:
            url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
            if small_tablespace is not None:
                import psycopg

                with psycopg.connect(url, autocommit=True) as connection:
                    connection.execute(f"CREATE TABLESPACE small LOCATION '{small}'")
                    connection.execute("ALTER DATABASE postgres SET default_tablespace = small")
            yield url
        finally:
            run("pg_ctl", "-D", data, "-m", "immediate", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _prefixes(folder: Path, small: Path, small_tablespace: int | None) -> tuple[list[str], list[str]]:
    """What PostgreSQL's programs are run under (initdb refuses root), and what the server
    is started under: with a small tablespace, a user namespace where this user is
    PostgreSQL's (the files stay this user's), inside the mount namespace of the tmpfs."""
    as_root = os.geteuid() == 0
    if small_tablespace is None:
        prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
        if as_root:
            shutil.chown(folder, "postgres")
        return prefix, prefix
    from small_disk import on_small_disk, require_small_disks

    require_small_disks()
    small.mkdir()
    user = pwd.getpwnam("postgres") if as_root else pwd.getpwuid(os.getuid())  # a name initdb can look up
    prefix = ["unshare", "--user", f"--map-user={user.pw_uid}", f"--map-group={user.pw_gid}", "--"]
    return prefix, on_small_disk(small, small_tablespace, prefix)
