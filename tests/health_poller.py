"""The ``/health`` poller of :func:`tests.serving.watched`, a process of its own.

In the test process it shared the GIL with the server under test, the test and their worker
threads: each hop of a poll waited its turn at the interpreter (up to 5 ms each), so a CI run
saw /health 105-115 ms where the server's event loop was never held that long. Out here it
times what a client of the server sees. Standard library only, so that it starts in tens of
milliseconds; one process serves a whole test run.

Commands, one a line on stdin: ``watch URL EVERY`` answers ``ready`` once a first GET has
connected, then polls every EVERY seconds until the next line (``stop``), and answers the
polls' times as a JSON list (``null`` for a poll that failed or was not a 200).
"""

from __future__ import annotations

import http.client
import json
import select
import sys
import time
from urllib.parse import urlsplit


def _get(connection: http.client.HTTPConnection) -> bool:
    connection.request("GET", "/health")
    answer = connection.getresponse()
    answer.read()
    return answer.status == 200


def watch(url: str, every: float) -> list[float | None]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    times: list[float | None] = []
    try:
        _get(connection)  # the connection made before timing starts
    finally:
        print("ready", flush=True)
    while True:  # at least once, however short the block
        sent = time.perf_counter()
        try:
            ok = _get(connection)
        except (OSError, http.client.HTTPException):
            ok = False
            connection.close()  # reconnects at the next request
        times.append(time.perf_counter() - sent if ok else None)
        if select.select([sys.stdin], [], [], every)[0]:
            sys.stdin.readline()  # "stop"
            connection.close()
            return times


def main() -> None:
    for line in sys.stdin:
        command, url, every = line.split()
        assert command == "watch", command
        print(json.dumps(watch(url, float(every))), flush=True)


if __name__ == "__main__":
    main()
