"""What the rest of the runtime needs to know of model files without loading the
converter: whether a path is one, its parts, the converter's version and its error.
(The converter itself imports gguf-py, onnx and the tokenizer tables: 170 ms, measured,
paid only when a file is converted.)"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CONVERTER_VERSION", "GgufError", "is_model_file", "split_parts"]


class GgufError(ValueError):
    """The file is not one this converter can turn into a model (the message says why)."""


def is_model_file(path: Path) -> bool:
    """Whether ``path`` names a model file this package converts (a GGUF file)."""
    return path.suffix.lower() == ".gguf" and not path.is_dir()


CONVERTER_VERSION = 6
"""Part of every converted folder's cache key: raise it when the folders it writes change."""

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path]:
    """The files of a model: ``path`` itself, or every part of a split file
    (``NAME-00001-of-00003.gguf``), checked to be all there."""
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise GgufError(f"the split model lacks {', '.join(missing)} beside {path.name}")
    return parts
