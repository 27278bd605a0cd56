"""Stored Responses outlive the server: `ortserve serve --state-dir` restarted after SIGTERM
or SIGKILL answers `previous_response_id` and `GET /v1/responses/{id}` as before, through
the openai SDK against real processes."""

from __future__ import annotations

import shutil
import signal
import sqlite3
from pathlib import Path

import httpx
import openai
import pytest
from serving import LORA_ADAPTERS, LORA_MODEL
from test_connections import serving, stopped_log


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_response_chain_continues_across_a_restart(tmp_path: Path, stop: signal.Signals) -> None:
    state = tmp_path / "state"
    with serving("--state-dir", str(state)) as (process, url), _client(url) as client:
        first = client.responses.create(
            model="tiny", input="Remember the word heliotrope.", max_output_tokens=4, store=True
        )
        streamed = client.responses.create(
            model="tiny", input="Another one.", max_output_tokens=4, stream=True, store=True
        )
        finals = ("response.completed", "response.incomplete")
        second_id = next(event.response.id for event in streamed if event.type in finals)  # type: ignore[union-attr]
        process.send_signal(stop)
        process.wait(timeout=30)
    assert (state / "ortserve.db").is_file()
    with serving("--state-dir", str(state)) as (_, url), _client(url) as client:
        kept = client.responses.retrieve(first.id)
        assert kept.output_text == first.output_text
        follow = client.responses.create(
            model="tiny", input="Which word?", previous_response_id=first.id, max_output_tokens=4
        )
        assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
        if stop == signal.SIGTERM:  # drained: the streamed one was written as it completed
            assert client.responses.retrieve(second_id).id == second_id
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)


def test_state_dir_none_keeps_nothing(tmp_path: Path) -> None:
    with serving("--state-dir", "none") as (_, url), _client(url) as client:
        first = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=True)
    with serving("--state-dir", "none") as (_, url), _client(url) as client, pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with sqlite3.connect(state / "ortserve.db") as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(AssertionError, match="written by a newer ortserve"), serving("--state-dir", str(state)):
        pass


def test_adapters_loaded_over_http_are_served_after_a_restart(tmp_path: Path) -> None:
    """SIGKILL after loading two adapters and unloading one: the restarted server serves the
    one kept (answering as before), not the unloaded one; a kept adapter whose file is gone
    is logged and the server serves the rest."""
    state = tmp_path / "state"
    kept = tmp_path / "alpha.onnx_adapter"
    gone = tmp_path / "beta.onnx_adapter"
    shutil.copy(LORA_ADAPTERS["alpha"], kept)
    shutil.copy(LORA_ADAPTERS["beta"], gone)
    args = ("--state-dir", str(state), "--model", f"lora={LORA_MODEL}", "--allow-runtime-adapters")
    with serving(*args) as (process, url), _client(url) as client:
        for name, path in (("alpha", kept), ("beta", gone), ("gamma", kept)):
            loaded = httpx.post(
                f"{url}/v1/load_lora_adapter", json={"lora_name": f"lora:{name}", "lora_path": str(path)}
            )
            assert loaded.status_code == 200, loaded.text
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "lora:gamma"}).status_code == 200
        before = client.completions.create(model="lora:alpha", prompt="The", max_tokens=6, temperature=0)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    gone.unlink()
    with serving(*args) as (process, url), _client(url) as client:
        served = {model.id for model in client.models.list().data}
        assert {"lora:alpha", "lora"} <= served and not {"lora:beta", "lora:gamma"} & served
        after = client.completions.create(model="lora:alpha", prompt="The", max_tokens=6, temperature=0)
        assert after.choices[0].text == before.choices[0].text
        log = stopped_log(process)
    assert "lora:beta" in log and "not served again" in log
