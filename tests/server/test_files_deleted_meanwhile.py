"""Files and batches deleted or ended while they are still in use, through a real server
(twenty-seventh probe, issue 45): a download under way when its file is deleted ends whole,
and a key's ended batches stop holding its share of the room for files and batches."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from ortserve_server import ServerConfig, create_app
from postgres import postgres_server
from serving import TINY_MODEL, running


def _batch_file(lines: int, size: int) -> bytes:
    """A batch input file of ``lines`` chat lines, each with ``size`` bytes of text."""
    text = "abcdefghij" * (size // 10)
    return b"".join(
        json.dumps(
            {
                "custom_id": str(i),
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"{i} {text}"}], "max_tokens": 1},
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )


def _upload(url: str, content: bytes, headers: dict[str, str] | None = None) -> str:
    uploaded = httpx.post(
        f"{url}/v1/files", headers=headers, data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}, timeout=60
    )
    assert uploaded.status_code == 200, uploaded.text
    file_id: str = uploaded.json()["id"]
    return file_id


@contextlib.contextmanager
def _logged() -> Iterator[list[logging.LogRecord]]:
    """What uvicorn logs meanwhile (its loggers do not propagate to pytest's)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_file_deleted_while_it_downloads_is_downloaded_whole(database: str, tmp_path: Path) -> None:
    """The download began with a Content-Length of the whole file, then ended at the piece
    the delete had removed: ~5 MB of 10, a closed connection, and a traceback in the log."""
    content = _batch_file(16, 2**20)  # 16 MiB: more than the socket buffers hold between the two
    with contextlib.ExitStack() as stack:
        where = (
            {"state_dir": tmp_path} if database == "sqlite" else {"state_url": stack.enter_context(postgres_server())}
        )
        config = ServerConfig(models={"tiny": TINY_MODEL}, max_file_size=32 << 20, max_body_size=2 << 20, **where)
        url = stack.enter_context(running(create_app(config)))
        file_id = _upload(url, content)
        logged = stack.enter_context(_logged())
        address = urlsplit(url)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the server waits on this reader
            sock.settimeout(60)
            sock.connect((address.hostname, address.port))
            sock.sendall(
                f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: {address.netloc}\r\nConnection: close\r\n\r\n".encode()
            )
            received = b""
            while b"\r\n\r\n" not in received or len(received) < 256 << 10:  # the headers and a little
                chunk = sock.recv(64 << 10)
                assert chunk, received
                received += chunk
            assert httpx.delete(f"{url}/v1/files/{file_id}").status_code == 200
            assert httpx.get(f"{url}/v1/files/{file_id}/content").status_code == 404  # gone at once for others
            assert file_id not in httpx.get(f"{url}/v1/files").text
            while chunk := sock.recv(1 << 20):
                received += chunk
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and f"content-length: {len(content)}".encode() in head.lower()
        assert body == content
        # uvicorn logs an application's exception before it closes the connection
        assert not [r for r in logged if "Exception in ASGI application" in r.getMessage()], logged


def _ended(url: str, headers: dict[str, str], batch_id: str) -> dict[str, object]:
    """The batch once it is over (polled: how long its lines take is the runner's affair)."""
    while True:
        batch: dict[str, object] = httpx.get(f"{url}/v1/batches/{batch_id}", headers=headers).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(0.05)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_keys_ended_batches_leave_its_share_of_the_room(database: str, tmp_path: Path) -> None:
    """An ended batch's lines (requests and answers) held its key's share for 30 days, with no
    route to delete a batch: a key with no file left was refused its next batch, and told to
    delete its files."""
    content = _batch_file(4, 2000).replace(b'"tiny"', b'"missing"')  # lines answered 404 at once
    with contextlib.ExitStack() as stack:
        where = (
            {"state_dir": tmp_path} if database == "sqlite" else {"state_url": stack.enter_context(postgres_server())}
        )
        # Two keys: each holds half the room, about two and a half input files.
        config = ServerConfig(
            models={"tiny": TINY_MODEL}, api_key=("alice", "bob"), files_max_bytes=len(content) * 5, **where
        )
        url = stack.enter_context(running(create_app(config)))
        alice = {"Authorization": "Bearer alice"}
        for _ in range(3):  # a file and its batch's lines fit; with an ended batch's lines kept, the second did not
            file_id = _upload(url, content, alice)
            made = httpx.post(
                f"{url}/v1/batches",
                headers=alice,
                json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            )
            assert made.status_code == 200, made.text
            batch = _ended(url, alice, made.json()["id"])
            assert batch["request_counts"] == {"total": 4, "completed": 0, "failed": 4}, batch
            errors = httpx.get(f"{url}/v1/files/{batch['error_file_id']}/content", headers=alice)
            assert [json.loads(line)["custom_id"] for line in errors.text.splitlines()] == ["0", "1", "2", "3"]
            listed = httpx.get(f"{url}/v1/batches", headers=alice).json()["data"]
            assert batch in listed, listed  # listed as retrieved
            for each in httpx.get(f"{url}/v1/files", headers=alice).json()["data"]:
                assert httpx.delete(f"{url}/v1/files/{each['id']}", headers=alice).status_code == 200
        held = [_upload(url, content, alice) for _ in range(2)]
        refused = httpx.post(
            f"{url}/v1/files", headers=alice, data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}
        )
        assert refused.status_code == 413, refused.text
        message = refused.json()["error"]["message"]
        assert f"{len(content) * 2} bytes in its files, 0 in its batches still running" in message, message
        assert len(held) == 2
