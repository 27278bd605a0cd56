"""Converted folders kept under ``$ORTSERVE_CACHE/converted``, one per source digest and
converter version (for a checkpoint: precision, provider and og's version too).

A conversion writes into a temporary folder beside its final name and renames it when
complete, so a crash never leaves a half folder that looks whole (the next conversion of
that file removes what a killed one left) (the conversion runs in a
child process: :mod:`._gguf_process`, :mod:`._checkpoint`); a lock file keeps two
processes from converting the same file at once (the second waits, then finds the
folder). The digest is SHA-256 over the file's bytes (every part of a split file), kept in
a small index by path, size and modification time so that a restart does not read a
multi-gigabyte file again.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from stat import S_ISREG

from ._gguf_process import convert_in_child
from ._names import CONVERTER_VERSION, CheckpointPrecision, SourceError, checkpoint_files, source_kind, split_parts

__all__ = ["cache_root", "converted_folder", "file_digest"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22
_DIGEST = re.compile(r"[0-9a-f]{64}")
"""What the index may give for a file: a digest names the converted folder, so any other
text there ('../../x') would name a folder outside the cache."""


def cache_root() -> Path:
    """``$ORTSERVE_CACHE/converted`` (``~/.cache/ortserve`` when unset)."""
    return Path(os.environ.get("ORTSERVE_CACHE", Path.home() / ".cache" / "ortserve")) / "converted"


def file_digest(path: Path, progress: Callable[[float], None] = lambda fraction: None) -> str:
    """SHA-256 of ``path``'s parts (a checkpoint's files), remembered by (path, size,
    mtime) in the cache's index."""
    parts = checkpoint_files(path) if path.is_dir() else split_parts(path)
    stats = [part.stat() for part in parts]
    for part, stat_result in zip(parts, stats, strict=True):
        # A FIFO blocked the load's open() for good, /dev/zero hashed for ever (the fifteenth probe).
        if not S_ISREG(stat_result.st_mode):
            raise SourceError(f"{part} is not a regular file")
    key = "|".join(f"{part.resolve()}:{s.st_size}:{s.st_mtime_ns}" for part, s in zip(parts, stats, strict=True))
    index_path = cache_root() / "digests.json"
    known = _digest_index(index_path).get(key)
    if isinstance(known, str) and _DIGEST.fullmatch(known):
        return known
    digest = hashlib.sha256()
    total = sum(s.st_size for s in stats) or 1
    done = 0
    for part in parts:
        with part.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                done += len(chunk)
                progress(done / total)
    value = digest.hexdigest()
    with contextlib.suppress(OSError, ValueError):
        index_path.parent.mkdir(parents=True, exist_ok=True)
        index = _digest_index(index_path)
        index[key] = value
        _write_atomically(index_path, json.dumps(index))
    return value


def _digest_index(path: Path) -> dict[str, object]:
    """The cache's index of digests, or an empty one where it is missing or not an object
    (a list there made every GGUF model fail to load: ``'list' object has no attribute 'get'``)."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def converted_folder(
    source: Path,
    progress: Callable[[float], None] = lambda fraction: None,
    *,
    precision: CheckpointPrecision | None = None,
    provider: str = "cpu",
) -> Path:
    """The genai folder of the model file or checkpoint ``source``: from the cache, or
    made now (blocks; ``progress`` gets fractions of the work: 0-0.1 reading the digest,
    then the weights). Both kinds convert in a child process. ``precision`` (default
    int4) and ``provider`` apply to a checkpoint (og's builder writes for one provider); a
    GGUF file keeps its own types."""
    kind = source_kind(source)
    if kind is None:
        raise SourceError(f"{source} is neither a GGUF file nor a transformers checkpoint")
    if kind == "gguf" and precision is not None:
        raise SourceError(f"{source.name} is a GGUF file: its weights keep the file's types (no precision applies)")
    if kind == "checkpoint":
        from ._checkpoint import BUILD_VERSION, builder_provider

        precision = precision or "int4"
        target = builder_provider(precision, provider)  # refused before the files are read
    digest = file_digest(source, lambda f: progress(0.1 * f))
    if kind == "gguf":
        name = f"{digest[:32]}-v{CONVERTER_VERSION}"
    else:
        import onnxruntime_genai as og  # the builder's version is part of what it wrote

        name = f"{digest[:32]}-{precision}-{target.lower()}-og{og.__version__}-b{BUILD_VERSION}"
    folder = cache_root() / name
    if (folder / "genai_config.json").exists() and _whole(folder):
        progress(1.0)
        return folder
    failed = _FAILED.get(folder)
    if failed is not None:  # the same bytes fail the same way: no child started again
        raise type(failed)(str(failed))
    folder.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock  # here: a folder already converted needs no lock (20 ms of every start-up)

    with FileLock(folder.with_name(folder.name + ".lock")):
        if (folder / "genai_config.json").exists():
            if _whole(folder):  # another process converted it meanwhile
                progress(1.0)
                return folder
            logger.warning("%s is not as it was written (a file cut or changed in size): converting again", folder)
            shutil.rmtree(folder, ignore_errors=True)
        # A process killed while converting left its temporary folder (as large as the
        # model); holding the lock, no other one converts into this name now.
        for stale in folder.parent.glob(glob.escape(folder.name) + ".tmp-*"):
            logger.warning("removing %s, left by a conversion that did not end", stale)
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        logger.info("converting %s into %s", source, folder)
        scratch = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        try:
            if kind == "gguf":
                convert_in_child(source, scratch, lambda f: progress(0.1 + 0.9 * f))
            else:
                from ._checkpoint import build_checkpoint

                assert precision is not None
                build_checkpoint(source, scratch, precision, provider, lambda f: progress(0.1 + 0.9 * f))
            scratch.rename(folder)
        except SourceError as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            if not exc.transient:
                if len(_FAILED) >= _KEPT_FAILURES:
                    _FAILED.pop(next(iter(_FAILED)))
                _FAILED[folder] = exc
            raise
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        logger.info("converted %s in %.1f s", source.name, time.monotonic() - started)
    progress(1.0)
    return folder


_MAX_SOURCE_JSON = 1 << 20
"""``ortserve_source.json`` is some kilobytes; read no more than this of it (one made a link
to /dev/zero was read until memory ran out: seventeenth probe)."""


def _whole(folder: Path) -> bool:
    """Whether the converted ``folder``'s files weigh what its conversion wrote (a folder
    converted before the sizes were kept is converted again)."""
    try:
        with (folder / "ortserve_source.json").open("rb") as file:
            text = file.read(_MAX_SOURCE_JSON + 1)
        sizes = json.loads(text) if len(text) <= _MAX_SOURCE_JSON else None
        sizes = sizes.get("sizes") if isinstance(sizes, dict) else None
    except (OSError, ValueError, RecursionError):  # nested past what json decodes (eighteenth probe)
        return False
    if not isinstance(sizes, dict) or not all(isinstance(size, int) for size in sizes.values()):
        return False
    try:
        return all((folder / str(name)).stat().st_size == size for name, size in sizes.items())
    except OSError:  # one is gone
        return False


_FAILED: dict[Path, SourceError] = {}
"""Conversions that failed for what the file holds, by the folder they would have made (the
file's digest): each request to a bad file started a conversion child again (fifteenth
probe of issue 45). In this process only: a new converter version may succeed."""
_KEPT_FAILURES = 64


def _write_atomically(path: Path, text: str) -> None:
    scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    scratch.write_text(text, encoding="utf-8")
    scratch.replace(path)
