"""A real full disk (issue 45, item 9): the state on a filesystem of 2 MB (a tmpfs in a
mount namespace of the server's own, see ``small_disk``), and PostgreSQL's tables in a
tablespace on one of 1 MB. Uploads and stored responses that do not fit are a 507
``insufficient_storage`` saying nothing was stored; the server serves on and what it
stored before is whole. (``test_storage_api`` makes SQLite's own SQLITE_FULL with
``max_page_count``; here the disk itself is full: ENOSPC and PostgreSQL's 53100.)"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ortserve_server import ServerConfig, create_app
from postgres import postgres_server
from serving import TINY_MODEL, running
from small_disk import on_small_disk, require_small_disks
from test_connections import serving, stopped_log

pytestmark = pytest.mark.slow

METADATA = {f"k{i}": random.Random(i).randbytes(256).hex() for i in range(16)}  # 8 KB that does not compress


def _file(lines: int, seed: int = 0) -> bytes:
    """``lines`` chat lines of some 1 KB of text that does not compress (PostgreSQL's
    TOAST compresses what it stores), the same for the same ``seed``."""
    text = random.Random(seed)
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": text.randbytes(450).hex()}]},
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )


def _fill_and_check(client: openai.OpenAI, base: str) -> None:
    """Store a response and a file, fill the disk with uploads until one is refused, then
    hold each write that no longer fits to a 507 and what was kept to its content."""
    kept = client.responses.create(model="tiny", input="kept", max_output_tokens=2, store=True)
    kept_file = client.files.create(file=("kept.jsonl", _file(3)), purpose="batch")
    refusals: list[openai.APIStatusError] = []
    for lines in (128, 16, 1):  # to within one line of full
        for seed in range(1, 101):
            try:
                client.files.create(file=("fill.jsonl", _file(lines, seed)), purpose="batch")
            except openai.APIStatusError as exc:
                refusals.append(exc)
                break
        else:
            pytest.fail(f"100 uploads of {lines} lines all fitted: the disk is not small")
    with pytest.raises(openai.APIStatusError) as stored:
        client.responses.create(model="tiny", input="hi", max_output_tokens=1, store=True, metadata=METADATA)
    for caught in [*refusals, stored.value]:
        assert caught.status_code == 507, caught.message
        assert isinstance(caught.body, dict) and caught.body["code"] == "insufficient_storage"
        assert "nothing was stored" in caught.message
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=1).output  # still serving
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    assert client.files.content(kept_file.id).content == _file(3)
    assert httpx.get(f"{base}/health").status_code == 200


def test_a_full_state_disk_is_a_507_and_nothing_is_lost(tmp_path: Path) -> None:
    """The state dir and the temporary folder (where an upload past 1 MiB is spooled as it
    arrives) on one 2 MB filesystem: SQLite's writes and the spool's both meet ENOSPC."""
    require_small_disks()

    def launcher(command: list[str]) -> list[str]:
        return on_small_disk(tmp_path, 2_000_000, command)

    with (
        serving("--state-dir", str(tmp_path / "state"), launcher=launcher, env={"TMPDIR": str(tmp_path)}) as (
            process,
            base,
        ),
        openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client,
    ):
        with pytest.raises(openai.APIStatusError) as spooled:  # 3.3 MB: the spool itself fills the disk
            client.files.create(file=("big.jsonl", _file(3500)), purpose="batch")
        assert spooled.value.status_code == 507, spooled.value.message
        _fill_and_check(client, base)
        log = stopped_log(process)
    assert "No space left on device" in log and "database or disk is full" in log, log[-2000:]
    assert "Traceback" not in log


def test_a_full_postgresql_tablespace_is_a_507_and_nothing_is_lost(caplog: pytest.LogCaptureFixture) -> None:
    """PostgreSQL's disk_full (53100, "could not extend file"): its tables on 1 MB."""
    logger = logging.getLogger("ortserve.server")  # it does not propagate to the root logger
    logger.addHandler(caplog.handler)
    try:
        with postgres_server(small_tablespace=1_000_000) as url:
            app: Any = create_app(ServerConfig(models={"tiny": TINY_MODEL}, state_url=url))
            with running(app) as base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
                _fill_and_check(client, base)
    finally:
        logger.removeHandler(caplog.handler)
    full = [record.getMessage() for record in caplog.records if record.getMessage().startswith("no room to store")]
    assert full and all("could not extend file" in message for message in full), full


def test_a_model_file_converted_onto_a_full_disk_is_a_507_tried_again(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Sixteenth probe: a GGUF file converted into a full cache was a 500 and remembered as
    a bad file, refused at once from then on, even once there was room. Now a 507 naming
    the model, and each request tries again."""
    require_small_disks()
    from gguf_files import write_tiny_gguf

    source = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")

    def launcher(command: list[str]) -> list[str]:
        return on_small_disk(tmp_path, 200_000, command)

    with serving(
        "--lazy", "--model", f"g={source}", launcher=launcher, env={"ORTSERVE_CACHE": str(tmp_path / "cache")}
    ) as (process, base):
        body = {"model": "g", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for _ in range(2):  # the second a 507 too: tried again (a remembered failure was a 500 at once)
            answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert answer.status_code == 507, answer.text
            error = answer.json()["error"]
            assert error["code"] == "insufficient_storage" and error["param"] == "model", error
            assert "tiny.gguf" in error["message"], error
            # Seventeenth probe: the model was left "error" and /health a 503 for every model.
            health = httpx.get(f"{base}/health")
            assert health.status_code == 200, health.text
            assert {m["id"]: m["status"] for m in health.json()["models"]}["g"] == "unloaded"
        assert httpx.post(f"{base}/v1/chat/completions", json={**body, "model": "tiny"}, timeout=60).status_code == 200
        log = stopped_log(process)
    assert log.count("no room to store") == 2 and "Traceback" not in log, log[-2000:]
