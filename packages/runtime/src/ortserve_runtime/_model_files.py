"""A model folder's files read with bounds: each is a regular file of a plausible size
before anything reads it whole.

A fourteenth probe of the hardening issue: a ``tokenizer.json`` linked to ``/dev/zero``
grew the server by 23.6 GiB until the kernel killed it (and every other model with it); a
``genai_config.json`` of 500 MB held the GIL for over a second as ``json.loads`` read it
(``/health`` 1.1-1.5 s, +1 GiB); one nested 100,000 deep ended start-up with a raw
``RecursionError``. Real files are far smaller than these bounds."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from ._errors import ModelLoadError

__all__ = ["MAX_GRAPH_BYTES", "MAX_SETTINGS_BYTES", "MAX_TOKENIZER_BYTES", "checked_file", "read_json_file"]

MAX_SETTINGS_BYTES = 16 << 20
"""A JSON settings file (genai_config.json, tokenizer_config.json, config.json, a voice's
.onnx.json) or a chat template: real ones are kilobytes, a few hundred with many added tokens."""

MAX_GRAPH_BYTES = 2 << 30
"""An ONNX graph file: protobuf's own limit (weights past it are external data files)."""

MAX_TOKENIZER_BYTES = 256 << 20
"""tokenizer.json: the largest real ones (Gemma 3's 262k tokens) are about 33 MB."""


def checked_file(path: Path, limit: int) -> Path:
    """``path``, once known to be a regular file (after links) of at most ``limit`` bytes;
    else :class:`ModelLoadError` saying which it is not."""
    try:
        found = path.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"{path} does not exist", path=path) from None
    except OSError as exc:
        raise ModelLoadError(f"{path} could not be read: {exc}", path=path) from exc
    if not stat.S_ISREG(found.st_mode):
        raise ModelLoadError(f"{path} is not a regular file", path=path)
    if found.st_size > limit:
        raise ModelLoadError(f"{path} is {found.st_size:,} bytes; a {path.name} may have at most {limit:,}", path=path)
    return path


def read_json_file(path: Path, limit: int = MAX_SETTINGS_BYTES) -> Any:
    """The JSON value in ``path`` (checked as :func:`checked_file`), or
    :class:`ModelLoadError` naming the file."""
    checked_file(path, limit)
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise ModelLoadError(f"{path} is not valid JSON: {reason}", path=path) from exc
