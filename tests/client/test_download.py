"""`pull` through the real huggingface_hub against a local stand-in for the Hub."""

from __future__ import annotations

import asyncio
import fnmatch
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import FakeHub
from ortserve_client import DownloadError, HubReference
from ortserve_client._download import DownloadComplete, DownloadProgress, apull, pull
from serving import running

BIG = os.urandom(1_500_000)
FILES = {
    "genai_config.json": b'{"model": {}}',
    "model.onnx": BIG,
    "cpu/model.onnx": b"cpu variant",
    "cpu/tokenizer.json": b"{}",
}


@pytest.fixture
def hub() -> FakeHub:
    return FakeHub(repos={"acme/tiny": dict(FILES)})


@pytest.fixture(autouse=True)
def _isolated_hub_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """huggingface_hub reads HF_HUB_OFFLINE and the token paths once, at its import (which
    may have happened before this module, under any environment): set its copies too, and
    keep a developer's saved token away from the stand-in Hub."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr("huggingface_hub.constants.HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))


@pytest.fixture
def endpoint(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with running(hub.app()) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        # The hub library writes (and so can resume from) whole chunks of this size; a
        # smaller chunk lets a 1.5 MB test file show resumption mid-file.
        monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 65536)
        yield url


def test_fresh_pull_with_progress(endpoint: str, tmp_path: Path) -> None:
    events: list[object] = []
    path = pull("acme/tiny", cache_dir=tmp_path, on_progress=events.append)
    for name, data in FILES.items():
        assert (path / name).read_bytes() == data
    progress = [e for e in events if isinstance(e, DownloadProgress) and e.filename == "model.onnx"]
    done = [e.bytes_done for e in progress]
    assert done == sorted(done) and done[-1] == len(BIG)
    assert all(e.bytes_total == len(BIG) for e in progress)
    assert events[-1] == DownloadComplete(repo_id="acme/tiny", path=path)


def test_subfolder_pull_fetches_only_that_folder(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    path = pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path)
    assert path.name == "cpu"
    assert sorted(p.name for p in path.iterdir()) == ["model.onnx", "tokenizer.json"]
    assert {p for p, _ in hub.ranges} == {"cpu/model.onnx", "cpu/tokenizer.json"}


def test_interrupted_download_resumes_with_a_range_request(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    hub.drop_after["model.onnx"] = 600_000
    path = pull("acme/tiny", allow_patterns=["model.onnx"], cache_dir=tmp_path)
    assert (path / "model.onnx").read_bytes() == BIG
    requests = [r for p, r in hub.ranges if p == "model.onnx"]
    assert requests[0] is None
    assert requests[1] is not None and requests[1].startswith("bytes=")
    resumed_at = int(requests[1].split("=")[1].rstrip("-"))
    assert 500_000 < resumed_at <= 600_000
    assert hub.bytes_sent["model.onnx"] - 600_000 + resumed_at == len(BIG)  # only the unwritten tail again


def test_an_aborted_pull_leaves_a_usable_cache(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    """huggingface_hub >= 2 deletes a partial file when its process gives up (unique temp
    names, huggingface_hub#4228), so resumption happens within one pull, not across runs;
    what must hold is that an aborted pull corrupts nothing."""

    class HostDied(Exception):
        pass

    def die_midway(event: object) -> None:
        if isinstance(event, DownloadProgress) and event.bytes_done >= 400_000:
            raise HostDied

    with pytest.raises(HostDied):
        pull("acme/tiny", allow_patterns=["model.onnx"], cache_dir=tmp_path, on_progress=die_midway)
    assert not list(tmp_path.rglob("*.incomplete"))
    path = pull("acme/tiny", allow_patterns=["model.onnx"], cache_dir=tmp_path)
    assert (path / "model.onnx").read_bytes() == BIG


def test_missing_repo(endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match=r"'acme/nothing' does not exist") as info:
        pull("acme/nothing", cache_dir=tmp_path)
    assert info.value.repo_id == "acme/nothing"


def test_missing_revision(endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="revision 'v9'"):
        pull("acme/tiny", revision="v9", cache_dir=tmp_path)


def test_missing_file_or_subfolder(endpoint: str, tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="no files matching"):
        pull("acme/tiny", allow_patterns=["weights.bin"], cache_dir=tmp_path)
    with pytest.raises(DownloadError, match="nothing"):
        pull("acme/tiny", subfolder="nothing", cache_dir=tmp_path)


def test_offline_uses_the_cache(endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    online = pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path) == online
    with pytest.raises(DownloadError, match="not in the local cache") as info:
        pull("acme/other", cache_dir=tmp_path)
    assert info.value.repo_id == "acme/other"


def test_token_is_sent_and_never_shown(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    secret = "hf_supersecret123"
    pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path, token=secret)
    assert hub.auth and set(hub.auth) == {f"Bearer {secret}"}
    for repo_id in ("acme/nothing", "acme/tiny"):  # 404 from the Hub, 500 on a file
        hub.fail_get["model.onnx"] = 500
        with pytest.raises(DownloadError) as info:
            pull(repo_id, cache_dir=tmp_path / "other", token=secret)
        assert secret not in str(info.value) and secret not in repr(info.value)


def test_token_from_the_environment(
    endpoint: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path)
    assert set(hub.auth) == {None}  # no token anywhere: none sent
    monkeypatch.setenv("HF_TOKEN", "hf_fromenv")
    pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path / "again")
    assert "Bearer hf_fromenv" in hub.auth


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_unreachable_hub_without_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", _closed_port_url())
    with pytest.raises(DownloadError, match=r"'acme/tiny' is not in the local cache .* could not be reached") as info:
        pull("acme/tiny", cache_dir=tmp_path, token="hf_secret")
    assert info.value.repo_id == "acme/tiny" and "hf_secret" not in str(info.value)


def test_unreachable_hub_falls_back_to_the_cache(
    endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    online = pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", _closed_port_url())
    events: list[object] = []
    assert pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path, on_progress=events.append) == online
    assert events == [DownloadComplete("acme/tiny", online)]


def test_server_error_on_a_file_names_the_file(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    hub.fail_get["cpu/model.onnx"] = 500
    with pytest.raises(DownloadError, match=r"file 'cpu/model.onnx' of repo 'acme/tiny' .*HTTP 500") as info:
        pull("acme/tiny", subfolder="cpu", cache_dir=tmp_path)
    assert info.value.filename == "cpu/model.onnx"
    assert not list(tmp_path.rglob("*.incomplete"))


@pytest.mark.anyio
async def test_async_pull(endpoint: str, tmp_path: Path) -> None:
    threads: set[int] = set()
    events: list[object] = []

    def record(event: object) -> None:
        threads.add(threading.get_ident())
        events.append(event)

    path = await apull("acme/tiny", subfolder="cpu", cache_dir=tmp_path, on_progress=record)
    assert (path / "model.onnx").read_bytes() == b"cpu variant"
    assert threads == {threading.get_ident()}  # callbacks run on the loop's thread ...
    assert events[-1] == DownloadComplete("acme/tiny", path)  # ... all of them before apull returns


@pytest.mark.anyio
async def test_cancelling_apull_stops_the_download(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    hub.chunk_delay = 0.01  # about 1 s for the big file
    started = asyncio.Event()
    task = asyncio.create_task(
        apull("acme/tiny", allow_patterns=["model.onnx"], cache_dir=tmp_path, on_progress=lambda e: started.set())
    )
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 10
    while list(tmp_path.rglob("*.incomplete")) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the worker stops at its next chunk and removes its file
    assert not list(tmp_path.rglob("*.incomplete"))
    assert not list(tmp_path.rglob("model.onnx"))
    assert hub.bytes_sent.get("model.onnx", 0) < len(BIG)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_server_cli_serves_a_model_from_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ortserve serve --model NAME=hf:OWNER/REPO/SUBFOLDER` downloads, then serves it."""
    import json
    import subprocess
    import sys

    import httpx

    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2"
    files = {f"cpu/{p.name}": p.read_bytes() for p in tiny.iterdir()}
    hub = FakeHub(repos={"acme/tiny-qwen2": files})
    with running(hub.app()) as url:
        env = {**os.environ, "HF_ENDPOINT": url, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ortserve_server",
                "serve",
                "--port",
                "0",
                "--ready-json",
                "--model",
                "tiny=hf:acme/tiny-qwen2/cpu",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert process.stdout is not None
            ready = json.loads(process.stdout.readline())
            base = f"http://127.0.0.1:{ready['port']}/v1"
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            assert httpx.post(f"{base}/chat/completions", json=body).status_code == 200
        finally:
            process.terminate()
            process.communicate(timeout=30)
    assert list(tmp_path.rglob("genai_config.json"))
    del monkeypatch


def test_cli_pull_then_ls(tmp_path: Path) -> None:
    """`ortserve pull OWNER/REPO/SUBFOLDER` prints the folder; `ortserve ls` then lists it."""
    import subprocess
    import sys

    tiny = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2"
    hub = FakeHub(repos={"acme/tiny-qwen2": {f"cpu/{p.name}": p.read_bytes() for p in tiny.iterdir()}})
    with running(hub.app()) as url:
        env = {**os.environ, "HF_ENDPOINT": url, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}
        pulled = subprocess.run(
            [sys.executable, "-m", "ortserve_server", "pull", "acme/tiny-qwen2/cpu"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        ).stdout.strip()
        missing = subprocess.run(
            [sys.executable, "-m", "ortserve_server", "pull", "acme/nothing"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    assert (Path(pulled) / "genai_config.json").exists()
    assert missing.returncode == 1 and "acme/nothing" in missing.stderr and "Traceback" not in missing.stderr
    listing = subprocess.run(
        [sys.executable, "-m", "ortserve_server", "ls"], capture_output=True, text=True, env=env, timeout=60, check=True
    ).stdout
    assert f"acme/tiny-qwen2/cpu\t{pulled}" in listing


# -- hf: references (HubReference): a folder, or one GGUF file of a repo ---------------------

GGUF_FILES = {
    "tiny-Q4_0.gguf": b"GGUF q4_0",
    "tiny-Q8_0.gguf": b"GGUF q8_0" * 1000,
    "q4/tiny.gguf": b"GGUF in a folder",
    "q4/notes.md": b"# notes",
    "big/big-00001-of-00003.gguf": b"GGUF part 1",
    "big/big-00002-of-00003.gguf": b"part 2",
    "big/big-00003-of-00003.gguf": b"part 3",
    "big/big-Q8_0.gguf": b"GGUF another quantization",
    "broken-00001-of-00002.gguf": b"GGUF a part whose sibling is missing",
    "README.md": b"# tiny",
}


def test_references_parse() -> None:
    assert HubReference.parse("/models/tiny.gguf") is None  # local paths pass through
    assert HubReference.parse(Path("models/tiny")) is None
    folder = HubReference.parse("hf:acme/tiny/cpu/int4")
    assert folder == HubReference("acme/tiny", "cpu/int4")
    assert folder.allow_patterns is None and folder.files == ()
    assert HubReference.parse("hf:acme/tiny") == HubReference("acme/tiny")
    assert HubReference.parse("hf:acme/tiny/") == HubReference("acme/tiny")
    file = HubReference.parse("hf:acme/tiny/q4/tiny-Q4_K_M.GGUF")
    assert file == HubReference("acme/tiny", "q4", "tiny-Q4_K_M.GGUF")
    assert file.allow_patterns == ["tiny-Q4_K_M.GGUF"]
    assert str(file) == "hf:acme/tiny/q4/tiny-Q4_K_M.GGUF"
    split = HubReference.parse(Path("hf:acme/tiny/big-00002-of-00003.gguf"))  # as `--model` gives it
    assert split is not None and split.subfolder is None
    assert split.files == ("big-00001-of-00003.gguf", "big-00002-of-00003.gguf", "big-00003-of-00003.gguf")
    odd = HubReference.parse("hf:acme/tiny/[draft]*.gguf")  # fnmatch's characters match themselves
    assert odd is not None and odd.allow_patterns == ["[[]draft][*].gguf"]
    assert fnmatch.fnmatch("[draft]*.gguf", odd.allow_patterns[0])
    assert not fnmatch.fnmatch("d*.gguf", odd.allow_patterns[0])
    for bad in ("hf:acme", "hf:", "hf:acme/tiny/../other", "hf:acme/tiny/m-00004-of-00003.gguf"):
        with pytest.raises(ValueError, match=r"hf:|part number"):
            HubReference.parse(bad)


def _pull_reference(text: str, cache_dir: Path) -> Path:
    reference = HubReference.parse(text)
    assert reference is not None
    folder = pull(
        reference.repo_id, subfolder=reference.subfolder, allow_patterns=reference.allow_patterns, cache_dir=cache_dir
    )
    return reference.local_path(folder)


def test_gguf_reference_downloads_only_that_file(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/tiny-GGUF"] = dict(GGUF_FILES)
    path = _pull_reference("hf:acme/tiny-GGUF/tiny-Q4_0.gguf", tmp_path)
    assert path.is_file() and path.name == "tiny-Q4_0.gguf" and path.read_bytes() == b"GGUF q4_0"
    assert {p for p, _ in hub.ranges} == {"tiny-Q4_0.gguf"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-Q4_0.gguf"]
    inside = _pull_reference("hf:acme/tiny-GGUF/q4/tiny.gguf", tmp_path)  # in a folder of the repo
    assert inside.read_bytes() == b"GGUF in a folder" and inside.parent.name == "q4"
    assert {p for p, _ in hub.ranges} == {"tiny-Q4_0.gguf", "q4/tiny.gguf"}


def test_split_gguf_reference_downloads_every_part(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    hub.repos["acme/tiny-GGUF"] = dict(GGUF_FILES)
    path = _pull_reference("hf:acme/tiny-GGUF/big/big-00001-of-00003.gguf", tmp_path)
    assert path.name == "big-00001-of-00003.gguf" and path.read_bytes() == b"GGUF part 1"
    parts = sorted(p for p, _ in hub.ranges)
    assert parts == [f"big/big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]  # not big-Q8_0.gguf
    assert (path.parent / "big-00003-of-00003.gguf").read_bytes() == b"part 3"  # beside the first
    with pytest.raises(DownloadError, match=r"'broken-00002-of-00002.gguf' of repo 'acme/tiny-GGUF'") as info:
        _pull_reference("hf:acme/tiny-GGUF/broken-00001-of-00002.gguf", tmp_path)
    assert info.value.filename == "broken-00002-of-00002.gguf"
    with pytest.raises(DownloadError, match="no files matching"):
        _pull_reference("hf:acme/tiny-GGUF/absent.gguf", tmp_path)


def test_gguf_reference_offline(endpoint: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub.repos["acme/tiny-GGUF"] = dict(GGUF_FILES)
    online = _pull_reference("hf:acme/tiny-GGUF/tiny-Q4_0.gguf", tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _pull_reference("hf:acme/tiny-GGUF/tiny-Q4_0.gguf", tmp_path) == online
    # The cached snapshot exists but lacks this file: said so, rather than a path to nothing.
    with pytest.raises(DownloadError, match=r"'tiny-Q8_0.gguf' of repo 'acme/tiny-GGUF' was not downloaded"):
        _pull_reference("hf:acme/tiny-GGUF/tiny-Q8_0.gguf", tmp_path)


@pytest.mark.anyio
async def test_local_server_resolves_a_gguf_reference(
    endpoint: str, hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LocalServer` downloads with `apull` (progress to on_event) and hands over the file."""
    from ortserve_client import LocalServer

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    hub.repos["acme/tiny-GGUF"] = dict(GGUF_FILES)
    events: list[object] = []
    local = tmp_path / "local.gguf"
    server = LocalServer({"a": "hf:acme/tiny-GGUF/tiny-Q8_0.gguf", "b": local}, on_event=events.append)
    path = await server._resolve(server.models["a"])
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == GGUF_FILES["tiny-Q8_0.gguf"]
    assert path.is_relative_to(tmp_path / "hub")
    assert {e.filename for e in events if isinstance(e, DownloadProgress)} == {"tiny-Q8_0.gguf"}
    assert events[-1] == DownloadComplete("acme/tiny-GGUF", path.parent)
    assert await server._resolve(local) == local  # a local file passes through
    with pytest.raises(ValueError, match="hf:OWNER/REPO"):
        LocalServer({"bad": "hf:acme"})


def test_server_cli_serves_a_gguf_file_from_the_hub(tmp_path: Path) -> None:
    """`ortserve serve --model NAME=hf:OWNER/REPO/FILE.gguf` downloads that file alone,
    converts it and serves it (the tiny GGUF's random weights say random words)."""
    import json
    import subprocess
    import sys

    import openai
    from gguf_files import write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    hub = FakeHub(repos={"acme/tiny-GGUF": {"tiny.gguf": tiny, "tiny-other.gguf": b"never fetched", "README.md": b""}})
    with running(hub.app()) as url:
        env = {
            **os.environ,
            "HF_ENDPOINT": url,
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_OFFLINE": "0",
            "ORTSERVE_CACHE": str(tmp_path / "cache"),
        }
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json"),
                *("--state-dir", "none", "--model", "smol=hf:acme/tiny-GGUF/tiny.gguf"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            while '"converting"' in line:  # progress while the file converts (a slow box prints some)
                line = process.stdout.readline()
            if not line:
                _, err = process.communicate(timeout=30)
                raise AssertionError(f"server exited {process.returncode}: {err}")
            base = f"http://127.0.0.1:{json.loads(line)['port']}/v1"
            with openai.OpenAI(base_url=base, api_key="x", max_retries=0) as client:
                raw = client.chat.completions.with_raw_response.create(
                    model="smol",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=8,
                    extra_body={"min_tokens": 4},  # no end of turn first: some text
                )
                assert raw.http_response.status_code == 200
                assert raw.parse().choices[0].message.content
        finally:
            process.terminate()
            process.communicate(timeout=30)
    assert {p for p, _ in hub.ranges} == {"tiny.gguf"}
    assert list((tmp_path / "cache" / "converted").rglob("genai_config.json"))


def test_cli_pulls_a_gguf_file_and_lists_it(tmp_path: Path) -> None:
    """`ortserve pull OWNER/REPO/FILE.gguf` prints the file's path; `ortserve ls` lists it."""
    import subprocess
    import sys

    hub = FakeHub(repos={"acme/tiny-GGUF": dict(GGUF_FILES)})
    with running(hub.app()) as url:
        env = {**os.environ, "HF_ENDPOINT": url, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}
        pulled = subprocess.run(
            [sys.executable, "-m", "ortserve_server", "pull", "acme/tiny-GGUF/big/big-00001-of-00003.gguf"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        ).stdout.strip()
    assert Path(pulled).name == "big-00001-of-00003.gguf" and Path(pulled).read_bytes() == b"GGUF part 1"
    listing = subprocess.run(
        [sys.executable, "-m", "ortserve_server", "ls"], capture_output=True, text=True, env=env, timeout=60, check=True
    ).stdout
    assert f"acme/tiny-GGUF/big/big-00001-of-00003.gguf\t{pulled}" in listing
    assert "00002-of-00003" not in listing  # a split file is listed once, by its first part


# Contents differ: the hub library fetches a blob once, however many names it has.
CHECKPOINT = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "generation_config.json": b'{"do_sample": false}',
    "model.safetensors": BIG,
    "tokenizer.json": b'{"model": {}}',
    "tokenizer_config.json": b'{"bos_token": null}',
    "chat_template.jinja": b"{{ messages }}",
    "merges.txt": b"#version: 0.2",
    "README.md": b"# a model",
    "pytorch_model.bin": b"the same weights for PyTorch",
    "flax_model.msgpack": b"and for Flax",
    "model.Q4_K_M.gguf": b"GGUF",
    "onnx/model.onnx": b"an export",
    "onnx/model_q4.onnx": b"another",
    "runs/events.out": b"training logs",
}


def test_a_checkpoint_repo_comes_without_its_other_formats(endpoint: str, hub: FakeHub, tmp_path: Path) -> None:
    """A transformers checkpoint's repo often carries ONNX exports, GGUF files and copies of
    the weights for other frameworks: serving it needs the safetensors, config and
    tokenizer, and only those are downloaded."""
    hub.repos["acme/checkpoint"] = dict(CHECKPOINT)
    hub.repos["acme/nested"] = {f"v2/{name}": data for name, data in CHECKPOINT.items()} | {"other.bin": b"x"}
    needed = [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    path = pull("acme/checkpoint", cache_dir=tmp_path)
    assert sorted(p.name for p in path.iterdir()) == needed
    assert (path / "model.safetensors").read_bytes() == BIG
    assert {p for p, _ in hub.ranges} == set(needed)
    nested = pull("acme/nested", subfolder="v2", cache_dir=tmp_path)
    assert sorted(p.name for p in nested.iterdir()) == needed
    # Without safetensors the PyTorch weights are the checkpoint's.
    hub.repos["acme/bin"] = {k: v for k, v in CHECKPOINT.items() if k != "model.safetensors"}
    assert "pytorch_model.bin" in {p.name for p in pull("acme/bin", cache_dir=tmp_path).iterdir()}
    # A genai folder, or a repo without config.json, comes whole, as before.
    assert len(list(pull("acme/tiny", cache_dir=tmp_path).rglob("*.onnx"))) == 2
