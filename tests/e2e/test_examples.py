"""Each mounting example runs as a script, keeps its own route, and streams a chat."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize(
    ("script", "prefix"), [("litestar_host.py", ""), ("starlette_host.py", "/llm"), ("flask_host.py", "/llm")]
)
def test_example_serves_a_streamed_chat(script: str, prefix: str) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / script)],
        env={**os.environ, "PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{root}/hello").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the example did not start"
            time.sleep(0.1)
        assert httpx.get(f"{root}/hello").json() == {"message": "the host's own route"}
        with openai.OpenAI(base_url=f"{root}{prefix}/v1", api_key="x", max_retries=0) as client:
            chunks = list(
                client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                )
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            plain = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
            )
        assert len(chunks) > 3
        assert streamed == plain.choices[0].message.content
        assert httpx.get(f"{root}{prefix}/health").json()["status"] == "ok"
    finally:
        process.terminate()
        try:
            process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def test_sidecar_example_starts_chats_and_stops() -> None:
    port = free_port()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "sidecar.py")],
        env={**os.environ, "PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("Spawned(") for line in lines)
    assert any(line.startswith("Ready(") for line in lines)
    assert any(line.startswith("reply: ") and len(line) > len("reply: ") for line in lines)
    assert any(line.startswith("streamed: ") and len(line) > len("streamed: ") for line in lines)
    assert "Exited(returncode=0)" in lines


def test_media_example_asks_about_an_image_and_subtitles_audio() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "media.py")],
        env={**os.environ, "PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer, _, subtitles = done.stdout.partition("subtitles:\n")
    assert answer.startswith("image answer (") and int(answer.split("(")[1].split()[0]) > 300
    assert subtitles.startswith("1\n00:00:0") and " --> " in subtitles


def test_agent_frameworks_example_runs_each_framework(tmp_path: Path) -> None:
    """The agent framework snippets of docs/guides/agent-frameworks.md, on the tiny model given a template without
    tools (as SmolLM2's): tools go into the system prompt, calls and answers parse."""
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(EXAMPLES.parent / "tests" / "fixtures" / "tiny-qwen2", plain)
    (plain / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        encoding="utf-8",
    )
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "agent_frameworks.py")],
        env={**os.environ, "PORT": str(free_port()), "ORTSERVE_EXAMPLE_MODEL": str(plain)},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # The random model writes unbounded city names: its call may be cut by max_tokens (then
    # LangChain lists it under invalid_tool_calls) and handed back so in the next turn.
    assert any(line.startswith("langchain tool call: ") for line in lines), lines
    assert any(line.startswith("langchain structured: city=") for line in lines), lines
    assert any(line.startswith("openai-agents: ") for line in lines), lines
    assert any(line.startswith("pydantic-ai: ") for line in lines), lines


def test_mcp_tools_example_calls_its_own_mcp_server() -> None:
    """The sidecar starts the example's MCP server over stdio and calls its tool: the
    printed output is the sum of the printed arguments (the server really ran)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "mcp_tools.py")],
        env={**os.environ, "PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "listed calc: add"
    call = lines[1]
    assert call.startswith("called add(")
    numbers, result = call.removeprefix("called add(").split(") -> ")
    a, b = (int(n) for n in numbers.split(", "))
    assert int(result) == a + b
    assert lines[2].startswith("answer:")
