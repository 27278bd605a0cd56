"""Model downloads from the Hugging Face Hub, on the real ``huggingface_hub``.

Files land in the standard Hub cache (shared with transformers and friends), so a model
pulled once is found again offline. The repo listing comes from one ``model_info`` call and
each file then goes through ``hf_hub_download``, rather than ``snapshot_download``, so
that progress can be reported per file, in bytes: the event types here are the ones the
sidecar forwards to its host. When a transfer breaks, the hub library resumes it with
a Range request from the bytes already written rather than fetching the file again.
When the Hub cannot be reached (``HF_HUB_OFFLINE=1``, no network, a 5xx), the cache
answers, as with ``snapshot_download``. The token comes from the argument or ``HF_TOKEN``
(read by the hub library at call time) and never appears in messages.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ._errors import DownloadError
from ._reference import literal_pattern

__all__ = ["DownloadComplete", "DownloadEvent", "DownloadProgress", "apull", "pull"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DownloadProgress:
    """Bytes of one file so far (``bytes_total`` is ``None`` when the server did not say)."""

    repo_id: str
    filename: str
    bytes_done: int
    bytes_total: int | None


@dataclass(frozen=True, slots=True)
class DownloadComplete:
    """Every file is in place; ``path`` is the model folder."""

    repo_id: str
    path: Path


DownloadEvent = DownloadProgress | DownloadComplete


def pull(
    repo_id: str,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    allow_patterns: Sequence[str] | None = None,
    on_progress: Callable[[DownloadEvent], None] | None = None,
    endpoint: str | None = None,
) -> Path:
    """Download a model (or one ``subfolder`` of a repo) and return its local folder.

    ``allow_patterns`` are fnmatch patterns, relative to ``subfolder`` when one is given.
    Without them the folder comes whole, except a transformers checkpoint: its weights in
    one format, config and tokenizer files, not the ONNX, GGUF or other copies published
    beside them.
    For an ``hf:OWNER/REPO[/PATH]`` reference (a folder or one GGUF file), see
    :class:`HubReference`: it gives these arguments and the path to serve.
    ``endpoint`` defaults to ``HF_ENDPOINT`` read now, not when ``huggingface_hub``
    was imported. With ``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached, a cached
    copy answers. Failures raise :class:`DownloadError`, naming the repo, revision and file.
    An exception raised by ``on_progress`` aborts the download and leaves no partial file.
    """
    return _pull(repo_id, subfolder, revision, cache_dir, token, allow_patterns, on_progress, endpoint, None)


async def apull(
    repo_id: str,
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    allow_patterns: Sequence[str] | None = None,
    on_progress: Callable[[DownloadEvent], None] | None = None,
    endpoint: str | None = None,
) -> Path:
    """:func:`pull` in a worker thread, so the event loop keeps running during a download.

    ``on_progress`` runs on the event loop's thread, so it may touch asyncio objects. If
    it raises, the loop's exception handler reports it and the download carries on.
    Cancelling the awaiting task stops the worker at the next chunk, and the partial
    file is removed.
    """
    deliver = None if on_progress is None else _on_loop(asyncio.get_running_loop(), on_progress)
    cancel = threading.Event()
    try:
        return await asyncio.to_thread(
            _pull, repo_id, subfolder, revision, cache_dir, token, allow_patterns, deliver, endpoint, cancel
        )
    finally:
        cancel.set()  # no-op once the worker is done; stops it if we were cancelled


def _on_loop(
    loop: asyncio.AbstractEventLoop, callback: Callable[[DownloadEvent], None]
) -> Callable[[DownloadEvent], None]:
    """``callback``, called from any thread, runs on ``loop`` (in order, before ``apull`` returns)."""

    def deliver(event: DownloadEvent) -> None:
        loop.call_soon_threadsafe(callback, event)

    return deliver


class _Cancelled(Exception):
    """Raised in the worker thread when the task awaiting :func:`apull` is cancelled."""


def _pull(
    repo_id: str,
    subfolder: str | None,
    revision: str | None,
    cache_dir: str | Path | None,
    token: str | None,
    allow_patterns: Sequence[str] | None,
    on_progress: Callable[[DownloadEvent], None] | None,
    endpoint: str | None,
    cancel: threading.Event | None,
) -> Path:
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = list(allow_patterns) if allow_patterns else None
    if subfolder:
        prefix = literal_pattern(subfolder.strip("/")) + "/"  # a folder name, not a pattern
        patterns = [prefix + p for p in patterns] if patterns else [prefix + "*"]
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    where = _where(repo_id, revision)

    def folder_of(snapshot: str | Path) -> Path:
        path = Path(snapshot) / subfolder if subfolder else Path(snapshot)
        if not path.is_dir():
            raise DownloadError(f"{where} has no folder {subfolder!r}", repo_id=repo_id, revision=revision)
        return path

    def from_cache(why: str, cause: BaseException | None) -> Path:
        try:
            snapshot = snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns, local_files_only=True
            )
        except LocalEntryNotFoundError as exc:
            raise DownloadError(
                f"{where} is not in the local cache and {why}", repo_id=repo_id, revision=revision
            ) from (cause or exc)
        if cause is not None:
            logger.warning("%s; using the cached copy of %s", why, repo_id)
        return _done(repo_id, folder_of(snapshot), on_progress)

    if _offline(constants):
        return from_cache("the Hub is offline (HF_HUB_OFFLINE)", None)
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, token=token)
    except Exception as exc:
        why = _unreachable(exc, endpoint or constants.ENDPOINT)
        if why is None:
            with _translate(repo_id, revision):
                raise
        return from_cache(why, exc)
    files = [
        s.rfilename
        for s in info.siblings or []
        if patterns is None or any(fnmatch.fnmatch(s.rfilename, p) for p in patterns)
    ]
    if not files:
        what = f"files matching {patterns}" if patterns else "files"
        raise DownloadError(f"{where} has no {what}", repo_id=repo_id, revision=revision)
    if allow_patterns is None:
        files = _checkpoint_files(files, f"{subfolder.strip('/')}/" if subfolder else "")
    snapshot = ""
    for filename in files:
        with _translate(repo_id, revision, filename):
            local = hf_hub_download(
                repo_id,
                filename,
                revision=revision,  # resolving the name records refs/<name> for offline use
                cache_dir=cache_dir,
                token=token,
                endpoint=endpoint,
                tqdm_class=_progress_class(repo_id, filename, on_progress, cancel),
            )
        snapshot = str(Path(str(local)).parents[len(Path(filename).parts) - 1])
    return _done(repo_id, folder_of(snapshot), on_progress)


_CHECKPOINT_EXTRAS = ("*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja")
"""What a transformers checkpoint needs beside its weights: config, generation config,
tokenizer (tokenizer.json, SentencePiece ``.model``, vocab and merges ``.txt``, tiktoken),
chat template, and the weights' index."""


def _checkpoint_files(files: Sequence[str], folder: str) -> list[str]:
    """Of a repo's ``files``, what serving the transformers checkpoint in ``folder`` needs,
    or ``files`` unchanged where ``folder`` holds no checkpoint.

    A checkpoint (``config.json`` with safetensors, else ``pytorch_model*.bin``, and no
    ``genai_config.json``; onnxruntime-genai's builder turns it into a model) is often
    published beside other forms of the same weights: ``onnx/`` exports, GGUF files, Flax,
    TensorFlow and PyTorch copies, several times its size. Only the files directly in the
    folder with the weights in one format are taken, as vLLM's loader does.
    """
    top = {name[len(folder) :]: name for name in files if name.startswith(folder) and "/" not in name[len(folder) :]}
    if "genai_config.json" in top or "config.json" not in top:
        return list(files)
    weights = [name for name in top if name.endswith(".safetensors")]
    weights = weights or [name for name in top if fnmatch.fnmatch(name, "pytorch_model*.bin")]
    if not weights:
        return list(files)
    wanted = [name for name in top if name in weights or any(fnmatch.fnmatch(name, p) for p in _CHECKPOINT_EXTRAS)]
    return [top[name] for name in sorted(wanted)]


def _where(repo_id: str, revision: str | None, filename: str | None = None) -> str:
    where = f"repo {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    return f"file {filename!r} of {where}" if filename else where


def _offline(constants: Any) -> bool:
    """``HF_HUB_OFFLINE`` as set now; the hub library's copy is read once, at its import."""
    value = os.environ.get("HF_HUB_OFFLINE")
    return bool(constants.HF_HUB_OFFLINE) if value is None else value.strip().lower() in {"1", "true", "yes", "on"}


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network-level failures: huggingface_hub 2.x speaks ``httpx2``, 1.x ``httpx``."""
    errors: list[type[BaseException]] = [httpx.TransportError]
    try:
        import httpx2
    except ImportError:  # pragma: no cover - huggingface_hub < 2
        pass
    else:
        errors.append(httpx2.TransportError)
    return tuple(errors)


def _unreachable(error: BaseException | None, endpoint: str) -> str | None:
    """Why the Hub could not answer (so the cache should), or ``None`` for a real answer."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    host = urlsplit(endpoint).netloc.rpartition("@")[2] or endpoint  # never userinfo
    if isinstance(error, OfflineModeIsEnabled):
        return "the Hub is offline (HF_HUB_OFFLINE)"
    if isinstance(error, _transport_errors()):
        return f"the Hub at {host} could not be reached ({type(error).__name__}: {error})"
    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", None)
        if isinstance(status, int) and status >= 500:
            return f"the Hub at {host} answered HTTP {status}"
    return None


def _done(repo_id: str, path: Path, on_progress: Callable[[DownloadEvent], None] | None) -> Path:
    if on_progress is not None:
        on_progress(DownloadComplete(repo_id=repo_id, path=path))
    return path


def _progress_class(
    repo_id: str,
    filename: str,
    on_progress: Callable[[DownloadEvent], None] | None,
    cancel: threading.Event | None,
) -> Any:
    """A tqdm subclass that draws nothing, reports bytes to ``on_progress`` and stops the
    transfer when ``cancel`` is set (the hub library calls ``update`` once per chunk)."""
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    class Progress(hub_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
            self._done = int(kwargs.get("initial") or 0)
            self._total = kwargs.get("total")
            self._report()

        def update(self, n: float | None = 1) -> bool | None:
            if cancel is not None and cancel.is_set():
                raise _Cancelled(filename)
            self._done += int(n or 0)  # negative when a server ignored Range and restarted
            self._report()
            return None

        def _report(self) -> None:
            if on_progress is not None:
                total = int(self._total) if self._total is not None else None
                on_progress(DownloadProgress(repo_id, filename, self._done, total))

    return Progress


class _translate:
    """Hub and network errors -> :class:`DownloadError` naming repo, revision and file."""

    def __init__(self, repo_id: str, revision: str | None, filename: str | None = None) -> None:
        self.repo_id, self.revision, self.filename = repo_id, revision, filename

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, DownloadError | _Cancelled) or not isinstance(exc, Exception):
            return
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        where = _where(self.repo_id, self.revision, self.filename)
        # Messages are ours, never the library's or the server's (which carry URLs, request
        # ids and, for some errors, headers): the token cannot reach them.
        if isinstance(exc, LocalEntryNotFoundError | OfflineModeIsEnabled):
            why = "is not in the local cache and the Hub is offline (HF_HUB_OFFLINE) or unreachable"
        elif isinstance(exc, GatedRepoError):
            why = "is gated: accept its terms on the Hub and pass a token (HF_TOKEN)"
        elif isinstance(exc, RepositoryNotFoundError):
            why = "does not exist (or is private: pass a token)"
        elif isinstance(exc, RevisionNotFoundError):
            why = "names a revision that does not exist"
        elif isinstance(exc, EntryNotFoundError):
            why = "does not exist"
        elif isinstance(exc, HfHubHTTPError):
            status = getattr(exc.response, "status_code", "?")
            why = f"could not be downloaded (HTTP {status})"
        elif isinstance(exc, _transport_errors()):
            why = f"could not be downloaded (network error, {type(exc).__name__}: {exc})"
        elif isinstance(exc, OSError):
            why = f"could not be downloaded ({type(exc).__name__}: {exc})"
        else:
            return
        raise DownloadError(
            f"{where} {why}", repo_id=self.repo_id, revision=self.revision, filename=self.filename
        ) from exc
