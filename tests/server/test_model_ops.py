"""Model operations through a real server: status fields, load/unload, keep_alive, idle
unload, LRU eviction, the memory budget, unloads under load and mid-stream, and auth."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import LORA_ADAPTERS, LORA_MODEL, TINY_MODEL, running

FIXTURES = TINY_MODEL.parent
THREE = {"a": FIXTURES / "tiny-qwen2", "b": FIXTURES / "tiny-qwen3-think", "c": FIXTURES / "tiny-gemma2-sliding"}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.contextmanager
def serve(**options: Any) -> Iterator[str]:
    """A lazy server (models load on first use) with ``options``; yields its base URL."""
    options.setdefault("models", {"tiny": TINY_MODEL})
    with running(create_app(ServerConfig(load_on_startup=False, **options))) as base:
        yield base


def card(base: str, name: str, **headers: str) -> dict[str, Any]:
    response = httpx.get(f"{base}/v1/models/{name}", headers=headers)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def states(base: str) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(f"{base}/v1/models").json()["data"]}


def control(base: str, action: str, model: str, key: str | None = None, **fields: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base}/v1/models/{action}", json={"model": model, **fields}, headers=headers, timeout=60)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.02)


def sdk(base: str, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def chat(client: openai.OpenAI, model: str = "tiny", **options: Any) -> str:
    result = client.chat.completions.create(model=model, messages=HELLO, max_tokens=3, **options)  # type: ignore[arg-type]
    return result.choices[0].finish_reason


def test_status_fields_load_unload_and_reload() -> None:
    with serve() as base, sdk(base) as client:
        [listed] = client.models.list().data
        assert listed.id == "tiny" and listed.model_extra is not None
        assert listed.model_extra["status"] == "unloaded" and listed.model_extra["kind"] == "generative"
        assert listed.model_extra["resident_bytes"] is None and listed.model_extra["in_flight"] == 0
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200 and health.json()["models"][0]["status"] == "unloaded"

        loaded = control(base, "load", "tiny")
        assert loaded.status_code == 200, loaded.text
        body = loaded.json()
        assert body["status"] == "ready" and body["engine"] == "ort-cpu" and body["provider"] == "cpu"
        assert body["prefill_int8"] is False  # the default; the tiny model has no int4 matrices anyway
        # The default serves the fastest path (decode-written rows reused): exact on request only.
        assert body["reproducible"] is False  # see tests/runtime/test_reproducible.py
        assert body["resident_bytes"] > 0 and body["kv_cache_bytes"] > 0
        assert body["in_flight"] == 0 and abs(body["last_used"] - time.time()) < 60
        assert body["expires_at"] is None  # no --idle-unload: kept until unloaded
        assert client.models.retrieve("tiny").model_extra == {
            k: v for k, v in body.items() if k not in ("id", "created", "owned_by", "object")
        }

        assert chat(client) == "length"
        unloaded = control(base, "unload", "tiny").json()
        assert unloaded["status"] == "unloaded" and unloaded["resident_bytes"] is None and unloaded["engine"] is None
        assert control(base, "unload", "tiny").json()["status"] == "unloaded"  # idempotent
        assert chat(client) == "length"  # a request to an unloaded model loads it
        assert card(base, "tiny")["status"] == "ready"


def test_idle_unload_and_keep_alive() -> None:
    with serve(idle_unload=1.0) as base, sdk(base) as client:
        chat(client)
        ready = card(base, "tiny")
        assert ready["status"] == "ready" and ready["expires_at"] is not None
        wait_until(lambda: card(base, "tiny")["status"] == "unloaded", timeout=5)

        chat(client, extra_body={"keep_alive": -1})  # kept loaded, whatever --idle-unload says
        time.sleep(1.5)
        assert card(base, "tiny")["status"] == "ready" and card(base, "tiny")["expires_at"] is None

        chat(client, extra_body={"keep_alive": 0})  # unloaded as soon as the request is over
        wait_until(lambda: card(base, "tiny")["status"] == "unloaded", timeout=5)

        assert control(base, "load", "tiny", keep_alive="1h").json()["expires_at"] > time.time() + 3000
        chat(client, extra_body={"keep_alive": "150ms"})
        wait_until(lambda: card(base, "tiny")["status"] == "unloaded", timeout=5)

        for bad in ("soon", True, "5 minutes", ""):
            with pytest.raises(openai.BadRequestError) as info:
                chat(client, extra_body={"keep_alive": bad})
            assert info.value.body["param"] == "keep_alive"  # type: ignore[index]
        assert control(base, "load", "tiny", keep_alive="x").status_code == 400


def test_lru_eviction_under_max_loaded_models() -> None:
    with serve(models=THREE, max_loaded_models=2) as base, sdk(base) as client:
        chat(client, "a")
        chat(client, "b")
        assert states(base) == {"a": "ready", "b": "ready", "c": "unloaded"}
        chat(client, "c")  # a is the least recently used
        assert states(base) == {"a": "unloaded", "b": "ready", "c": "ready"}
        chat(client, "b")
        control(base, "load", "a")  # now c is
        assert states(base) == {"a": "ready", "b": "ready", "c": "unloaded"}


@contextlib.contextmanager
def held_stream(base: str, model: str = "tiny") -> Iterator[Iterator[str]]:
    """A streamed chat whose reader stalls after the first event: its ~13 MB of events (8
    choices of 950 tokens with 20 top logprobs each) are more than the socket buffers
    take, so the server waits on the client and the request holds its model until the
    rest is read (the yielded lines) or the stream is closed (the client goes away)."""
    body = {
        "model": model,
        "messages": HELLO,
        "stream": True,
        "max_tokens": 950,
        "min_tokens": 950,
        "n": 8,
        "logprobs": True,
        "top_logprobs": 20,
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        yield lines


def events_of(lines: Iterator[str]) -> list[dict[str, Any] | str]:
    data = (line.removeprefix("data: ") for line in lines if line.startswith("data: "))
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_503_with_retry_after_when_nothing_can_be_evicted() -> None:
    models = {"a": THREE["a"], "b": THREE["b"]}
    with serve(models=models, max_loaded_models=1) as base, sdk(base) as client:
        with held_stream(base, "a"):
            assert card(base, "a")["in_flight"] == 1
            with pytest.raises(openai.APIStatusError) as info:
                chat(client, "b")
            assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
            error = info.value.body
            assert error["code"] == "model_capacity" and "max-loaded-models 1" in error["message"]  # type: ignore[index]
            assert states(base) == {"a": "ready", "b": "unloaded"}
        wait_until(lambda: card(base, "a")["in_flight"] == 0)
        assert chat(client, "b") == "length"  # a is idle now: evicted
        assert states(base) == {"a": "unloaded", "b": "ready"}


def test_memory_budget_evicts_idle_and_refuses_when_all_busy() -> None:
    models = {"a": THREE["a"], "b": THREE["b"]}
    # A KV cache of 128 MiB capacity each (zeroed pages: virtual until used), so that the
    # budget's arithmetic is not at the mercy of the few MiB a resident-set delta is off
    # by while another model is busy.
    big_cache = ModelConfig(max_batch_size=256)
    app = create_app(ServerConfig(models=models, load_on_startup=False, memory_budget=2**40, model_config=big_cache))
    with running(app) as base, sdk(base) as client:
        a = control(base, "load", "a").json()
        assert a["kv_cache_bytes"] == 128 * 2**20
        # Room for one of these models, not two; set once a's size is measured, as an
        # operator would size the budget.
        app.state.ortserve.registry.memory_budget = int((a["resident_bytes"] + a["kv_cache_bytes"]) * 1.5)
        assert chat(client, "b") == "length"  # a is idle: it makes room
        assert states(base) == {"a": "unloaded", "b": "ready"}
        with held_stream(base, "b"):
            for _ in range(2):
                with pytest.raises(openai.APIStatusError) as info:
                    chat(client, "a")
                assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
                error = info.value.body
                assert error["code"] == "model_capacity" and "memory budget" in error["message"]  # type: ignore[index]
                assert states(base) == {"a": "unloaded", "b": "ready"}
        wait_until(lambda: card(base, "b")["in_flight"] == 0)
        assert chat(client, "a") == "length"
        assert states(base) == {"a": "ready", "b": "unloaded"}


@pytest.mark.anyio
async def test_concurrent_requests_during_load_and_unload() -> None:
    with serve(models={"tiny": TINY_MODEL, "emb": THREE["a"]}) as base:
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:

            async def one(i: int) -> str:
                await asyncio.sleep(0.01 * (i % 7))
                result = await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)  # type: ignore[arg-type]
                return result.choices[0].finish_reason

            async def flip() -> list[int]:
                codes = []
                async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                    for action in ("load", "unload", "load", "unload", "unload", "load", "unload"):
                        response = await http.post(f"/v1/models/{action}", json={"model": "tiny"})
                        codes.append(response.status_code)
                        await asyncio.sleep(0.02)
                return codes

            results = await asyncio.gather(*(one(i) for i in range(24)), flip())
        finishes, codes = results[:-1], results[-1]
        assert finishes == ["length"] * 24  # none lost, none failed
        assert codes == [200] * 7
        assert card(base, "tiny")["in_flight"] == 0


def test_unload_while_streaming_waits_the_grace_period_then_ends_the_stream_in_band() -> None:
    with serve(unload_grace=0.3) as base, held_stream(base) as lines:
        began = time.monotonic()
        unloaded = control(base, "unload", "tiny")
        waited = time.monotonic() - began
        assert unloaded.status_code == 200 and unloaded.json()["status"] == "unloaded"
        assert waited >= 0.3  # the stream had the grace period first
        events = events_of(lines)
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert isinstance(error, dict) and error["error"]["code"] == "model_unloaded"
    assert "unloaded" in error["error"]["message"]
    finished = [c for e in events[:-2] if isinstance(e, dict) for c in e["choices"] if c["finish_reason"]]
    assert len(finished) < 8  # cut before every choice ended


def test_unload_waits_for_a_stream_to_finish() -> None:
    with serve(unload_grace=300) as base:
        outcome: list[httpx.Response] = []
        with held_stream(base) as lines:
            unloader = threading.Thread(target=lambda: outcome.append(control(base, "unload", "tiny")))
            unloader.start()
            wait_until(lambda: card(base, "tiny")["status"] == "unloading")
            with sdk(base) as client:  # a request arriving during the unload waits, then loads the model again
                late = threading.Thread(target=lambda: outcome.append(chat(client)))  # type: ignore[arg-type]
                late.start()
                time.sleep(0.2)
                assert card(base, "tiny")["status"] == "unloading" and not outcome
                events = events_of(lines)
                unloader.join(30)
                late.join(30)
        assert events[-1] == "[DONE]"
        finished = [c for e in events[:-1] if isinstance(e, dict) for c in e["choices"] if c["finish_reason"]]
        assert [c["finish_reason"] for c in finished] == ["length"] * 8  # every choice ran to its end
        unloaded, late_finish = outcome
        assert isinstance(unloaded, httpx.Response) and unloaded.json()["status"] == "unloaded"
        assert late_finish == "length"
        assert card(base, "tiny")["status"] == "ready"


def test_a_broken_folder_fails_clearly_then_loads_once_fixed(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    shutil.copytree(TINY_MODEL, folder)
    with serve(models={"tiny": folder}) as base, sdk(base) as client:
        (folder / "model.onnx").write_bytes(b"not a protobuf")
        for _ in range(2):  # each request tries again
            with pytest.raises(openai.InternalServerError) as info:
                chat(client)
            error = info.value.body
            assert error["code"] == "model_load_failed" and str(folder) in error["message"]  # type: ignore[index]
            assert "model.onnx" in error["message"]  # type: ignore[index]
        failed = card(base, "tiny")
        assert failed["status"] == "error" and "model.onnx" in failed["error"]
        response = control(base, "load", "tiny")
        assert response.status_code == 500 and response.json()["error"]["code"] == "model_load_failed"
        shutil.copy(TINY_MODEL / "model.onnx", folder / "model.onnx")
        assert chat(client) == "length"
        assert card(base, "tiny")["status"] == "ready" and card(base, "tiny")["error"] is None


def test_control_routes_need_the_api_key_or_the_admin_key() -> None:
    with serve(api_key="user-key") as base:
        assert control(base, "load", "tiny").status_code == 401
        assert control(base, "load", "tiny", key="wrong").status_code == 401
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert control(base, "load", "tiny", key="user-key").json()["status"] == "ready"
    with serve(api_key="user-key", admin_key="admin-key") as base:
        # An API key is a good key, not enough here: a 403 that says what the route needs.
        refused = control(base, "load", "tiny", key="user-key")
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        assert "needs the admin key" in refused.json()["error"]["message"]
        assert control(base, "unload", "tiny", key="user-key").status_code == 403
        assert control(base, "unload", "tiny", key="wrong").status_code == 401
        assert httpx.get(f"{base}/v1/usage", headers={"Authorization": "Bearer user-key"}).status_code == 403
        assert control(base, "load", "tiny", key="admin-key").json()["status"] == "ready"
        with sdk(base, "user-key") as client:
            assert chat(client) == "length"
        assert card(base, "tiny", Authorization="Bearer user-key")["status"] == "ready"
        assert control(base, "unload", "tiny", key="admin-key").json()["status"] == "unloaded"


def test_unloading_or_pinning_through_keep_alive_needs_the_admin_key() -> None:
    """With an admin key, an API caller cannot unload (keep_alive 0) or pin (negative, or
    longer than a day or ``--idle-unload`` where idle models unload) a model through a
    generation request: 403 naming keep_alive; a positive duration works, and the admin key
    works for all of them."""
    with serve(admin_key="admin-key") as base:
        with sdk(base) as client:
            for value in (0, -1, "-5m", "0s"):
                with pytest.raises(openai.PermissionDeniedError) as refused:
                    chat(client, extra_body={"keep_alive": value})
                assert refused.value.body["param"] == "keep_alive", value  # type: ignore[index]
            assert chat(client, extra_body={"keep_alive": "5m"}) == "length"
            # A moment is as good as 0: every key's next request would load the model again.
            for value in (0.001, "1ms", 5e-324, "59s"):
                with pytest.raises(openai.PermissionDeniedError, match="shorter than 60 seconds") as refused:
                    chat(client, extra_body={"keep_alive": value})
                assert refused.value.body["param"] == "keep_alive", value  # type: ignore[index]
            assert chat(client, extra_body={"keep_alive": "60s"}) == "length"
            # Past 100 years is for ever, so pinning: the 403 says so (it said "0 or negative").
            with pytest.raises(openai.PermissionDeniedError, match="past 100 years"):
                chat(client, extra_body={"keep_alive": 1e308})
            # Where idle models never unload, a long duration pins nothing the server would not keep.
            assert chat(client, extra_body={"keep_alive": "867000h"}) == "length"
        with sdk(base, "admin-key") as admin:
            assert chat(admin, extra_body={"keep_alive": -1}) == "length"
            assert chat(admin, extra_body={"keep_alive": 0}) == "length"
            assert chat(admin, extra_body={"keep_alive": 0.001}) == "length"
        messages = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "keep_alive": 0}
        assert httpx.post(f"{base}/v1/messages", json=messages).status_code == 403
        assert httpx.post(f"{base}/v1/messages", json=messages, headers={"x-api-key": "admin-key"}).status_code == 200
    with serve(admin_key="admin-key", idle_unload=10) as base, sdk(base) as client:
        assert chat(client, extra_body={"keep_alive": "10s"}) == "length"  # the operator's own idle time
        with pytest.raises(openai.PermissionDeniedError, match="shorter than 10 seconds"):
            chat(client, extra_body={"keep_alive": "5s"})
        # Sixteenth probe of issue 45: 98 years (just short of the 100 that count as for ever)
        # pinned the model past --idle-unload from any key. A day at most, without the admin key.
        for value in ("867000h", 3.1e9, "24h1s"):
            with pytest.raises(openai.PermissionDeniedError, match="longer than 86400 seconds") as refused:
                chat(client, extra_body={"keep_alive": value})
            assert refused.value.body["param"] == "keep_alive", value  # type: ignore[index]
        assert chat(client, extra_body={"keep_alive": "24h"}) == "length"
        with sdk(base, "admin-key") as admin:
            assert chat(admin, extra_body={"keep_alive": "867000h"}) == "length"
    with serve(admin_key="admin-key", idle_unload=172800) as base, sdk(base) as client:
        assert chat(client, extra_body={"keep_alive": "48h"}) == "length"  # the operator's own idle time
        with pytest.raises(openai.PermissionDeniedError, match="longer than 172800 seconds"):
            chat(client, extra_body={"keep_alive": "48h1s"})
    with serve() as base, sdk(base) as client:  # no admin key: the API caller decides, as before
        assert chat(client, extra_body={"keep_alive": 0}) == "length"


def test_only_configured_names_load(tmp_path: Path) -> None:
    with serve() as base:
        for name in (str(TINY_MODEL), "../tiny", "tiny/../tiny", "hf:owner/repo", ""):
            response = control(base, "load", name)
            assert response.status_code == 404, name
            assert response.json()["error"]["code"] == "model_not_found"
        refused = control(base, "load", "tiny", path=str(tmp_path))  # no field names a folder
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "path"
        assert control(base, "load", "tiny").json()["status"] == "ready"
        assert httpx.post(f"{base}/v1/models/load", json={"name": "tiny"}).status_code == 400
        assert states(base) == {"tiny": "ready"}


def test_keep_alive_durations() -> None:
    with serve() as base:
        for given, seconds in (("1h30m", 5400), (90, 90), ("2.5m", 150), ("45s", 45), ("1500ms", 1.5), ("120", 120)):
            expires = control(base, "load", "tiny", keep_alive=given).json()["expires_at"]
            assert abs(expires - (time.time() + seconds)) <= 2, given
        assert control(base, "load", "tiny", keep_alive="-1m").json()["expires_at"] is None


def test_keep_alive_on_every_api_family(tmp_path: Path) -> None:
    import anthropic
    from ortserve_server._demo import minilm_folder

    folder = minilm_folder(tmp_path / "minilm")
    assert folder is not None
    with (
        serve(models={"tiny": TINY_MODEL, "minilm": folder, "ranker": FIXTURES / "tiny-cross-encoder"}) as base,
        sdk(base) as client,
        anthropic.Anthropic(base_url=base, api_key="x", max_retries=0) as claude,
    ):
        unload_after: dict[str, Any] = {"extra_body": {"keep_alive": 0}}
        rerank = {"model": "ranker", "query": "q", "documents": ["a", "b"], "keep_alive": 0}
        score = {"model": "ranker", "text_1": "q", "text_2": ["a"], "keep_alive": 0}
        calls: list[tuple[str, Callable[[], object]]] = [
            (
                "tiny",
                lambda: client.responses.create(model="tiny", input="hi", max_output_tokens=2, **unload_after),
            ),
            ("tiny", lambda: claude.messages.create(model="tiny", max_tokens=2, messages=HELLO, **unload_after)),  # type: ignore[arg-type]
            ("tiny", lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2, **unload_after)),
            ("minilm", lambda: client.embeddings.create(model="minilm", input="hi", **unload_after)),
            ("ranker", lambda: httpx.post(f"{base}/v1/rerank", json=rerank).raise_for_status()),
            ("ranker", lambda: httpx.post(f"{base}/v1/score", json=score).raise_for_status()),
        ]
        for name, call in calls:
            control(base, "load", name)
            call()
            wait_until(lambda name=name: card(base, name)["status"] == "unloaded", timeout=5)  # type: ignore[misc]


def test_startup_loads_only_what_the_limits_allow() -> None:
    app = create_app(ServerConfig(models=THREE, max_loaded_models=2))
    with running(app) as base:
        assert states(base) == {"a": "ready", "b": "ready", "c": "unloaded"}
        assert httpx.get(f"{base}/health").status_code == 200
    with running(create_app(ServerConfig(models=THREE, memory_budget=1024))) as base:
        assert states(base) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}


def test_an_adapter_id_loads_and_unloads_its_model() -> None:
    lora = ModelConfig(adapters=dict(LORA_ADAPTERS))
    adapter = min(LORA_ADAPTERS)
    with serve(models={"lora": LORA_MODEL}, model_configs={"lora": lora}) as base:
        loaded = control(base, "load", f"lora:{adapter}").json()
        assert loaded["id"] == f"lora:{adapter}" and loaded["parent"] == "lora" and loaded["status"] == "ready"
        assert card(base, "lora")["status"] == "ready"
        missing = control(base, "load", "lora:nope")
        assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
        assert control(base, "unload", f"lora:{adapter}").json()["status"] == "unloaded"
        assert states(base) == {"lora": "unloaded", **{f"lora:{a}": "unloaded" for a in LORA_ADAPTERS}}


def test_a_model_unloaded_after_serving_frees_itself() -> None:
    """Thirteenth probe of issue 45: the contexts a request's tasks and timers copied kept
    the request's list of leases, so the model stayed alive after its unload: the unload
    gave the whole frozen heap back to the collector, and the load after it walked it all
    (/health 91-174 ms at each reload through `ortserve serve`, now 4-20 ms). Now the model
    frees itself at the unload and the heap stays frozen."""
    with serve(admin_key="admin-key") as base, sdk(base) as client:
        assert chat(client) == "length"
        assert gc.get_freeze_count() > 0  # frozen at the load
        assert control(base, "unload", "tiny", key="admin-key").json()["status"] == "unloaded"
        assert gc.get_freeze_count() > 0  # not given back: nothing kept the model
        assert chat(client) == "length"


def test_model_files_that_never_end_or_nest_without_end_fail_alone(tmp_path: Path) -> None:
    """Fourteenth probe of issue 45: a tokenizer.json (or genai_config.json, or the decoder
    graph) linked to /dev/zero was read whole, growing the server until the kernel killed it
    with every model; a 500 MB genai_config.json held the GIL over a second; one nested
    100,000 deep ended start-up with a RecursionError; 1,000,000 layers held the GIL 4 s.
    Each is a load error naming the file now, found before anything reads it whole."""

    def hostile(name: str, edit: Callable[[dict[str, Any]], None] = lambda genai: None, zero: str = "") -> Path:
        folder = tmp_path / name
        shutil.copytree(TINY_MODEL, folder)
        genai = json.loads((folder / "genai_config.json").read_text())
        edit(genai)
        (folder / "genai_config.json").write_text(json.dumps(genai))
        if zero:
            (folder / zero).unlink()
            (folder / zero).symlink_to("/dev/zero")
        return folder

    def huge(genai: dict[str, Any]) -> None:
        genai["padding"] = "x" * (17 << 20)

    def layers(genai: dict[str, Any]) -> None:
        genai["model"]["decoder"]["num_hidden_layers"] = 1_000_000

    def deep(genai: dict[str, Any]) -> None:
        genai["model"]["deep"] = json.loads("[" * 900 + "]" * 900)  # nested further below, as text

    expected = {
        "zero_tokenizer": (hostile("zero_tokenizer", zero="tokenizer.json"), "tokenizer.json is not a regular file"),
        "zero_config": (hostile("zero_config", zero="genai_config.json"), "genai_config.json is not a regular file"),
        "zero_graph": (hostile("zero_graph", zero="model.onnx"), "model.onnx is not a regular file"),
        "huge_config": (hostile("huge_config", huge), "a genai_config.json may have at most 16,777,216"),
        "deep_config": (hostile("deep_config", deep), "is not valid JSON: nested too deep"),
        "layers": (hostile("layers", layers), "gives 1,000,000 layers (model.decoder.num_hidden_layers)"),
    }
    deep_config = tmp_path / "deep_config" / "genai_config.json"
    deep_config.write_text(deep_config.read_text().replace("[]", "[" * 100_000 + "]" * 100_000))
    models = {"tiny": TINY_MODEL} | {name: folder for name, (folder, _) in expected.items()}
    with serve(models=models) as base, sdk(base) as client:
        for name, (_, reason) in expected.items():
            started = time.monotonic()
            refused = control(base, "load", name)
            assert refused.status_code >= 400 and reason in refused.json()["error"]["message"], (name, refused.text)
            assert time.monotonic() - started < 5, name
            assert card(base, name)["status"] == "error" and reason in card(base, name)["error"]
        assert chat(client) == "length"  # the good model serves beside them


def test_a_stopped_og_process_is_killed_and_its_model_loads_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fourteenth probe of issue 45: og's process of a multimodal model stopped (SIGSTOP;
    as a deadlock in native code would leave it) held every request of that model without
    end while /health said "ready". A call whose child answers nothing and uses no CPU time
    for ``WEDGED_SECONDS`` kills it now: the request fails naming why, the next one loads
    the model again; the other models serve throughout."""
    import os
    import signal

    from ortserve_runtime import _og_process

    monkeypatch.setattr(_og_process, "WEDGED_SECONDS", 1.0)  # the server runs in this process
    phi3v = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-phi3v"

    def og_children() -> list[int]:
        children = Path(f"/proc/{os.getpid()}/task")
        pids = [int(pid) for task in children.iterdir() for pid in (task / "children").read_text().split()]
        return [pid for pid in pids if b"_og_child" in Path(f"/proc/{pid}/cmdline").read_bytes()]

    with serve(models={"tiny": TINY_MODEL, "v": phi3v}) as base, sdk(base) as client:
        assert chat(client, "v") == "length"
        (child,) = og_children()
        os.kill(child, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as failed:
                chat(client, "v")
            assert "no answer and no CPU time for 1 s" in failed.value.message, failed.value.message
            assert time.monotonic() - started < 30
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGCONT)
        assert chat(client, "tiny") == "length"
        assert chat(client, "v") == "length"  # in a new process
        assert og_children() != [child]
