"""Model downloads from the Hugging Face Hub, on the real ``huggingface_hub``.

Files land in the standard Hub cache (shared with transformers and friends), so a model
pulled once is found again offline. Each file reports byte progress; a partial file
left by an interrupted download (``*.incomplete``) is resumed with a Range request
rather than fetched again; the token comes from the argument or ``HF_TOKEN`` and never
appears in messages.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import DownloadError

__all__ = ["DownloadComplete", "DownloadEvent", "DownloadProgress", "apull", "pull"]


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

    With ``HF_HUB_OFFLINE=1`` (or no network and a cached copy) the cache answers;
    failures raise :class:`DownloadError` naming the repo, revision and file.
    """
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download

    patterns = list(allow_patterns) if allow_patterns else None
    if subfolder:
        prefix = subfolder.strip("/") + "/"
        patterns = [prefix + p for p in patterns] if patterns else [prefix + "*"]
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    where = f"{repo_id}" + (f" (revision {revision})" if revision else "")

    def folder_of(snapshot: str | Path) -> Path:
        path = Path(snapshot) / subfolder if subfolder else Path(snapshot)
        if not path.is_dir():
            raise DownloadError(f"{where} has no folder {subfolder!r}", repo_id=repo_id, revision=revision)
        return path

    with _translate(repo_id, revision):
        if _offline(constants):
            snapshot = snapshot_download(
                repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns, local_files_only=True
            )
            return _done(repo_id, folder_of(snapshot), on_progress)
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, token=token, files_metadata=True)
        files = [
            s.rfilename
            for s in info.siblings or []
            if patterns is None or any(fnmatch.fnmatch(s.rfilename, p) for p in patterns)
        ]
        if not files:
            what = f"files matching {patterns}" if patterns else "files"
            raise DownloadError(f"{where} has no {what}", repo_id=repo_id, revision=revision)
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
                    tqdm_class=_progress_class(repo_id, filename, on_progress),
                )
            snapshot = str(Path(str(local)).parents[len(Path(filename).parts) - 1])
        return _done(repo_id, folder_of(snapshot), on_progress)


async def apull(repo_id: str, **kwargs: Any) -> Path:
    """:func:`pull` in a worker thread, for asyncio hosts."""
    return await asyncio.to_thread(pull, repo_id, **kwargs)


def _offline(constants: Any) -> bool:
    value = os.environ.get("HF_HUB_OFFLINE")
    return bool(constants.HF_HUB_OFFLINE) if value is None else value.strip().lower() in {"1", "true", "yes", "on"}


def _done(repo_id: str, path: Path, on_progress: Callable[[DownloadEvent], None] | None) -> Path:
    if on_progress is not None:
        on_progress(DownloadComplete(repo_id=repo_id, path=path))
    return path


def _progress_class(repo_id: str, filename: str, on_progress: Callable[[DownloadEvent], None] | None) -> Any:
    """A tqdm subclass that reports bytes to ``on_progress`` and draws nothing."""
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    class Progress(hub_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
            self._done = int(kwargs.get("initial") or 0)
            self._total = kwargs.get("total")
            self._report()

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
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
        if exc is None or isinstance(exc, DownloadError) or not isinstance(exc, Exception):
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

        where = f"repo {self.repo_id!r}" + (f" at revision {self.revision!r}" if self.revision else "")
        if self.filename:
            where = f"file {self.filename!r} of {where}"
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
            status = exc.response.status_code if exc.response is not None else "?"
            why = f"could not be downloaded (HTTP {status})"
        elif isinstance(exc, OSError | ConnectionError):
            why = f"could not be downloaded ({type(exc).__name__}: {exc})"
        else:
            return
        raise DownloadError(
            f"{where} {why}", repo_id=self.repo_id, revision=self.revision, filename=self.filename
        ) from exc
