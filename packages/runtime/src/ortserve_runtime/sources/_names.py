"""What the rest of the runtime needs to know of model sources without loading a
converter: whether a path is one (a GGUF file, a transformers checkpoint), its files, the
converters' versions and their error. (Both converters run in child processes: the GGUF
converter's imports, gguf-py, onnx and the tokenizer tables, are paid only there, and og's
builder with torch and transformers.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

__all__ = [
    "CHECKPOINT_PRECISIONS",
    "CONVERTER_VERSION",
    "CheckpointPrecision",
    "GgufError",
    "SourceError",
    "SourceKind",
    "checkpoint_files",
    "is_model_file",
    "source_kind",
    "split_parts",
]


class SourceError(ValueError):
    """The source is not one ortserve can turn into a model folder (the message says why)."""

    transient = False
    """Whether trying again may go otherwise (a converter killed for memory): the others
    are remembered, and the same file fails at once (see ``converted_folder``)."""


class GgufError(SourceError):
    """The file is not one this converter can turn into a model (the message says why)."""


SourceKind = Literal["gguf", "checkpoint"]
CheckpointPrecision = Literal["int4", "int8", "fp16", "fp32"]
CHECKPOINT_PRECISIONS: tuple[CheckpointPrecision, ...] = ("int4", "int8", "fp16", "fp32")


def is_model_file(path: Path) -> bool:
    """Whether ``path`` names a model file this package converts (a GGUF file)."""
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def source_kind(path: Path) -> SourceKind | None:
    """What ``path`` is when it is a source rather than a folder an engine drives: a GGUF
    file, or a transformers checkpoint of a generative model (``config.json`` naming a
    ``*ForCausalLM`` or ``*ForConditionalGeneration`` with ``*.safetensors`` or
    ``pytorch_model*.bin`` beside it, and no ``genai_config.json``: a genai folder is
    served as it is). An ``onnx/`` export beside the weights (transformers.js's, in many
    Hub repos) does not make such a folder an embedding model."""
    if is_model_file(path):
        return "gguf"
    if not path.is_dir() or (path / "genai_config.json").exists():
        return None
    try:
        architectures = json.loads((path / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    generative = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures
    )
    return "checkpoint" if generative and _weight_files(path) else None


def _weight_files(folder: Path) -> list[Path]:
    return sorted([*folder.glob("*.safetensors"), *folder.glob("pytorch_model*.bin")])


def checkpoint_files(folder: Path) -> list[Path]:
    """The files of a checkpoint that decide what its build is: the weights and every
    JSON, tokenizer and template file beside them (a changed tokenizer is another model)."""
    names = ("*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt")
    found = {p for pattern in names for p in folder.glob(pattern) if p.is_file()}
    return sorted(found | set(_weight_files(folder)))


CONVERTER_VERSION = 7
"""Part of every converted folder's cache key: raise it when the folders it writes change."""

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


_MAX_SPLIT_PARTS = 1024
"""Parts a split GGUF file may have: llama.cpp's gguf-split makes some tens for the largest models."""


def split_parts(path: Path) -> list[Path]:
    """The files of a model: ``path`` itself, or every part of a split file
    (``NAME-00001-of-00003.gguf``), checked to be all there."""
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if count > _MAX_SPLIT_PARTS:  # 99,999 parts named: 2.1 s of the event loop listing the missing ones
        raise GgufError(f"{path.name} says the model is split in {count:,} parts; at most {_MAX_SPLIT_PARTS} are read")
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise GgufError(f"the split model lacks {', '.join(missing[:3])}{more} beside {path.name}")
    return parts
