"""ortserve on Ray Serve: two replicas on a local Ray instance (127.0.0.1, no dashboard),
reached over HTTP with the openai SDK through Ray's proxy.

Needs the ``ray`` extra (``uv sync --extra ray``); skipped without it. The tests share
one Ray instance and run in order: spread, affinity, a killed replica, then 2 -> 1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from postgres import postgres_server

# Under `uv run`, Ray would start its workers with `uv run` in a copy of the project,
# which syncs the default environment, without the extra; the workers must use this one.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
ray = pytest.importorskip("ray", reason="needs the ray extra: uv sync --extra ray")
serve = pytest.importorskip("ray.serve")

from ortserve_server.ray import REPLICA_HEADER, affinity_key
from ray.serve.context import _get_global_client  # what `serve deploy` reaches over REST
from ray.serve.schema import ServeDeploySchema

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2"
TOOLS_SERVER = Path(__file__).resolve().parents[1] / "mcp_tools_server.py"
APP = "ortserve"
STREAM_TOKENS = 900  # the longest the 1024-token sequences allow after the prompt
SYSTEM = "You are a careful assistant who answers in short sentences and never invents facts. " * 3


# First in the module: it runs its own Ray before this module's starts (parallel test
# workers keep a module's tests together, so two Ray instances never share the cores).
def test_ray_example_holds_a_conversation_on_one_replica_and_serves() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parents[2] / "examples" / "ray_serve.py")],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        deadline = time.monotonic() + 180
        while not lines or not lines[-1].startswith("ready"):
            line = process.stdout.readline()
            assert line, f"the example ended: {lines}"
            lines.append(line.strip())
            assert time.monotonic() < deadline, lines
        turns = [line.split() for line in lines if line.startswith("replica ")]
        assert len(turns) == 3
        assert len({turn[1] for turn in turns}) == 1  # one replica for the whole conversation
        assert int(turns[0][-5]) == 0 and all(int(turn[-5]) > 0 for turn in turns[1:])  # "N from its prefix cache"
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert raw.headers["x-ortserve-replica"] and raw.parse().choices[0].message.content is not None
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


_STATE_URL: list[str] = []
"""The PostgreSQL the replicas share, where one could be started (see ``root``)."""


def _deploy(replicas: int) -> None:
    """Deploy as a serve config file (KubeRay's ``serveConfigV2``) does, and wait until
    ``replicas`` replicas run. Changing only ``num_replicas`` then scales the deployment
    in place; ``serve.run`` would give the code a new version and replace every replica."""
    args = {
        "model": f"tiny={MODEL}",
        "replica_cpus": "0.5",
        "engine": "ort-cpu",
        "threads": "1",  # two replicas share this machine's cores
        # One sequence at a time, so that streams queue on their replica and the one
        # removed in the 2 -> 1 test still has work under way when it is told to go.
        "max_batch_size": "1",
        "max_sequence_length": "1024",
        # The memory settings reach each replica's models (the card below says so).
        "kv_cache_dtype": "fp16",
        "prefix_cache_mb": "64",
        **({"state_url": _STATE_URL[0]} if _STATE_URL else {}),
        # Each replica starts its own stdio MCP server on first use.
        "mcp_server": f"tools=stdio:{sys.executable} {TOOLS_SERVER} stdio",
    }
    replica_options = {
        "name": "OrtServeReplica",
        "num_replicas": replicas,
        "health_check_period_s": 1.0,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    application = {
        "name": APP,
        "route_prefix": "/",
        "import_path": "ortserve_server.ray:app_builder",
        "args": args,
        "deployments": [replica_options],
    }
    _get_global_client().deploy_apps(ServeDeploySchema(applications=[application]))
    deadline = time.monotonic() + 120
    while True:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING" and _replica_count() == replicas:
            return
        assert time.monotonic() < deadline, status
        time.sleep(0.25)


def _replica_count() -> int:
    deployment = serve.status().applications[APP].deployments.get("OrtServeReplica")
    return int(deployment.replica_states.get("RUNNING", 0)) if deployment else 0


@pytest.fixture(scope="module")
def root() -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(pytest.skip.Exception):  # the replicas share a PostgreSQL where one can be started
            _STATE_URL.append(stack.enter_context(postgres_server()))
        yield stack.enter_context(_ray_serve())
    _STATE_URL.clear()


@contextlib.contextmanager
def _ray_serve() -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
        _deploy(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(root: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{root}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def _key(path: str, request: Any, prefix_chars: int = 1024) -> str | None:
    return affinity_key(path, json.dumps(request).encode(), prefix_chars)


def test_the_affinity_key_is_the_conversations_opening() -> None:
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    later = [*first, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "More"}]
    chat = "/v1/chat/completions"
    assert _key(chat, {"model": "m", "messages": first}) == _key(chat, {"model": "m", "messages": later})
    assert _key(chat, {"model": "m", "messages": first}) != _key(chat, {"model": "other", "messages": first})
    assert _key(chat, {"model": "m", "messages": first}) != _key(
        chat, {"model": "m", "messages": [system, {"role": "user", "content": "Bye"}]}
    )
    # A long shared system prompt fills the key: its chats share a replica, and its cache.
    long = {"role": "system", "content": "x" * 100}
    one, two = ([long, {"role": "user", "content": q}] for q in ("a", "b"))
    assert _key(chat, {"model": "m", "messages": one}, 50) == _key(chat, {"model": "m", "messages": two}, 50)
    # The other generating APIs: completions, responses, Anthropic messages.
    assert _key("/v1/completions", {"model": "m", "prompt": "abc"}) == _key(
        "/v1/completions", {"model": "m", "prompt": ["abc", "d"]}
    )
    assert _key("/v1/responses", {"model": "m", "input": "abc"}) is not None
    assert _key("/v1/messages", {"model": "m", "system": "s", "messages": first[1:]}) is not None
    # No preference: embeddings, GETs, bodies that are not a JSON object (the replica answers those).
    assert _key("/v1/embeddings", {"model": "m", "input": "abc"}) is None
    assert affinity_key("/v1/models", b"", 1024) is None
    assert affinity_key(chat, b"{not json", 1024) is None
    deep = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 900 + b"]" * 900 + b"}]}"
    assert affinity_key(chat, deep, 1024) is None  # a RecursionError in the proxy: its 500
    assert affinity_key(chat, b"[" * 5000 + b"]" * 5000, 1024) is None
    assert _key(chat, ["a list"]) is None
    assert _key(chat, {"model": "m", "messages": []}) is None


def test_bad_requests_get_openai_errors_through_ray(client: openai.OpenAI, root: str) -> None:
    broken = httpx.post(
        f"{root}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and set(broken.json()["error"]) == {"message", "type", "param", "code"}
    missing = httpx.post(f"{root}/v1/chat/completions", json={"model": "tiny"})
    assert missing.status_code == 400 and "messages" in missing.json()["error"]["message"]
    unknown = httpx.get(f"{root}/v1/nowhere")
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]
    huge = httpx.post(f"{root}/v1/chat/completions", content=b"x" * (16 * 1024 * 1024 + 1), timeout=60)
    assert huge.status_code == 413 and "body" in huge.json()["error"]["message"]
    assert _chat(client, [{"role": "user", "content": "still fine?"}])[1].choices  # and it keeps serving
    card = httpx.get(f"{root}/v1/models/tiny").json()
    assert card["kv_cache_dtype"] == "float16"


def test_an_answer_sent_in_chunks_comes_whole_through_ray(client: openai.OpenAI) -> None:
    """Answers past 1 MiB (here 900 tokens with 20 alternatives each) are written in pieces
    as the client reads them; Ray's proxy passes them on whole."""
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=900,
        extra_body={"min_tokens": 900},
        logprobs=True,
        top_logprobs=20,
    )
    content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
    assert content is not None and len(content) == 900 and all(len(t.top_logprobs) == 20 for t in content)


def _chat(client: openai.OpenAI, messages: list[Any], max_tokens: int = 4) -> tuple[str, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return raw.headers[REPLICA_HEADER], raw.parse()


def test_requests_spread_over_both_replicas_and_metrics_name_them(client: openai.OpenAI, root: str) -> None:
    before = _chat_requests_by_replica(root)
    served = [_chat(client, [{"role": "user", "content": f"question number {i}"}])[0] for i in range(40)]
    counts = {replica: served.count(replica) for replica in set(served)}
    assert len(counts) == 2, counts
    assert min(counts.values()) >= 5, counts  # rendezvous hashing of 40 openings: far from one-sided

    # Each replica counts a request once its response is out: poll until the last are in.
    deadline = time.monotonic() + 10
    while (totals := _since(before, _chat_requests_by_replica(root))) != counts:
        assert time.monotonic() < deadline, (totals, counts)
        time.sleep(0.1)


def _since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {replica: total - before.get(replica, 0) for replica, total in after.items() if total != before.get(replica)}


def _chat_requests_by_replica(root: str) -> dict[str, float]:
    metrics = httpx.get(f"{root}/metrics", timeout=30)
    assert metrics.status_code == 200
    totals: dict[str, float] = {}
    for line in metrics.text.splitlines():
        if line.startswith("ortserve_requests_total{") and 'endpoint="/v1/chat/completions"' in line:
            replica = line.split('replica="')[1].split('"')[0]
            totals[replica] = totals.get(replica, 0) + float(line.rsplit(" ", 1)[1])
    return totals


def test_a_conversation_stays_on_one_replica_and_reuses_its_prefix(client: openai.OpenAI) -> None:
    def conversation() -> list[tuple[str, int]]:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}]
        turns = []
        for question in ("What is a prefix cache?", "Why does it help?", "When does it miss?", "Thanks, bye."):
            messages.append({"role": "user", "content": question})
            replica, reply = _chat(client, messages, max_tokens=8)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            turns.append((replica, reply.usage.prompt_tokens_details.cached_tokens))
        return turns

    first, again = conversation(), conversation()
    assert len({replica for replica, _ in first + again}) == 1
    # Turn 1 is new; every later turn starts with the one before it, which the replica holds.
    assert all(cached > 0 for _, cached in first[1:] + again), first + again


def test_mcp_tools_run_on_the_replicas(client: openai.OpenAI) -> None:
    """``mcp_server`` reaches every replica: the MCP call is made where the model runs."""
    for number in range(2):  # the prefix router may send these to either replica
        response = client.responses.create(
            model="tiny",
            input=f"Look a word up ({number}, {time.time()})",
            tools=[{"type": "mcp", "server_label": "tools", "server_url": "unused", "require_approval": "never"}],
            tool_choice={"type": "mcp", "server_label": "tools", "name": "lookup"},  # type: ignore[arg-type, misc]
            max_tool_calls=1,
            max_output_tokens=16,
        )
        call = response.output[1]
        assert call.type == "mcp_call" and call.output == "ortserve: a word", call


def test_response_ids_name_the_replica_that_stores_them() -> None:
    from ortserve_server.ray import response_owner

    rid = "resp_ab12cd34-" + "0" * 32
    assert response_owner("POST", "/v1/responses", json.dumps({"previous_response_id": rid}).encode()) == "ab12cd34"
    assert response_owner("GET", f"/v1/responses/{rid}", b"") == "ab12cd34"
    assert response_owner("DELETE", f"/v1/responses/{rid}/", b"") == "ab12cd34"
    assert response_owner("POST", "/v1/responses", b'{"input": "hi"}') is None
    assert response_owner("POST", "/v1/responses", b"not json") is None
    assert response_owner("POST", "/v1/responses", b"[" * 5000 + b"]" * 5000) is None  # was a RecursionError
    assert response_owner("GET", "/v1/responses/resp_" + "0" * 32, b"") is None  # a plain server's id
    assert response_owner("POST", "/v1/chat/completions", b"{}") is None


def test_a_chain_of_stored_responses_follows_the_replica_holding_it(client: openai.OpenAI, root: str) -> None:
    """Stored responses live in the replica that made them: every follow-up turn
    (previous_response_id), GET and DELETE must reach it. Six turns on two replicas would
    all land there by chance 1 time in 32."""
    response = client.responses.create(model="tiny", input="Start a story.", max_output_tokens=4, store=True)
    owner = response.id.removeprefix("resp_").split("-")[0]
    for turn in range(6):
        raw = client.responses.with_raw_response.create(
            model="tiny",
            input=f"Go on, part {turn}.",
            previous_response_id=response.id,
            max_output_tokens=4,
            store=True,
        )
        assert raw.headers[REPLICA_HEADER] == owner
        response = raw.parse()
    assert client.responses.retrieve(response.id).id == response.id
    assert httpx.delete(f"{root}/v1/responses/{response.id}", timeout=30).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_killing_a_replica_process_keeps_the_service_answering(client: openai.OpenAI) -> None:
    kept = client.responses.create(model="tiny", input="Remember heliotrope.", max_output_tokens=4, store=True)
    victim = kept.id.removeprefix("resp_").split("-")[0]  # the replica that stored it
    conversation = [{"role": "user", "content": "who serves me? " + "again " * 5}]
    for _ in range(8):  # a conversation of the victim's (it stays there: see the test above)
        if _chat(client, conversation)[0] == victim:
            break
        conversation[0]["content"] += "!"
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#OrtServeReplica#{victim}", namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    os.kill(pid, signal.SIGKILL)

    # Every request gets an answer, the killed replica's own conversation included.
    served = [_chat(client, [{"role": "user", "content": f"still there {i}? who serves me?"}])[0] for i in range(10)]
    served.append(_chat(client, conversation)[0])
    assert victim not in served
    if _STATE_URL:  # the replicas share PostgreSQL: the victim's stored response lives on
        raw = client.responses.with_raw_response.create(
            model="tiny", input="Which word?", previous_response_id=kept.id, max_output_tokens=4
        )
        assert raw.headers[REPLICA_HEADER] != victim
        assert raw.parse().usage.input_tokens > kept.usage.input_tokens  # type: ignore[union-attr]

    # Ray replaces the replica: requests spread over two again, neither the victim.
    deadline = time.monotonic() + 90
    while True:
        served = [_chat(client, [{"role": "user", "content": f"after {i}"}])[0] for i in range(10)]
        assert victim not in served
        if len(set(served)) == 2:
            break
        assert time.monotonic() < deadline, serve.status()
        time.sleep(0.5)


def test_scaling_down_drains_streams_without_loss(client: openai.OpenAI) -> None:
    prompts = {i: [{"role": "user", "content": f"stream number {i}"}] for i in range(12)}
    reference = {}
    for i, messages in prompts.items():
        replica, done = _chat(client, messages, max_tokens=STREAM_TOKENS)
        reference[i] = (replica, done.choices[0].message.content)
    results: dict[int, tuple[str, str, str | None, float]] = {}

    def read(i: int) -> None:
        with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=prompts[i], max_tokens=STREAM_TOKENS, temperature=0, stream=True
        ) as response:
            text, finish = "", None
            for chunk in response.parse():
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            results[i] = (response.headers[REPLICA_HEADER], text, finish, time.monotonic())

    threads = [threading.Thread(target=read, args=(i,)) for i in prompts]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the streams are queued on both replicas
    scaled_at = time.monotonic()
    _deploy(1)  # returns once the application runs with one replica
    for thread in threads:
        thread.join(timeout=120)

    kept = _chat(client, prompts[0])[0]
    removed = ({replica for replica, _ in reference.values()} - {kept}).pop()
    assert sorted(results) == sorted(prompts)  # every stream ended
    for i, (_, text, finish, _) in results.items():
        assert finish is not None and text == reference[i][1]  # nothing lost, wherever it ran
    # The removed replica was still streaming when the scale-down began: it drained.
    assert any(replica == removed and ended > scaled_at for replica, _, _, ended in results.values())
