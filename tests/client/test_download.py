"""`pull` through the real huggingface_hub against a local stand-in for the Hub."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakehub import FakeHub
from ortserve_client import DownloadError
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


@pytest.fixture
def endpoint(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with running(hub.app()) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
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
    assert f"Bearer {secret}" in hub.auth
    with pytest.raises(DownloadError) as info:
        pull("acme/nothing", cache_dir=tmp_path, token=secret)
    assert secret not in str(info.value)


@pytest.mark.anyio
async def test_async_pull(endpoint: str, tmp_path: Path) -> None:
    path = await apull("acme/tiny", subfolder="cpu", cache_dir=tmp_path)
    assert (path / "model.onnx").read_bytes() == b"cpu variant"


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
