"""LoRA adapters: ``.onnx_adapter`` files checked against the decoder graph that takes them.

An adapter file (onnxruntime's format: what ``og.Adapters.load`` and
``onnxruntime.LoraAdapter`` read) holds tensors named after inputs of the decoder graph,
whose defaults (initializers) give the base model. Checked once at load, so that a wrong
file is a load error naming it rather than a failure of every request that picks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import onnx
import onnxruntime as ort

from .._errors import ModelLoadError
from .._folder import GenaiFolder

__all__ = ["check_adapters"]


def check_adapters(folder: GenaiFolder, adapters: Mapping[str, Path]) -> dict[str, Path]:
    """``adapters`` with absolute paths, each a readable adapter file whose tensors are
    inputs of ``folder``'s decoder; else :class:`ModelLoadError` naming the file."""
    if not adapters:
        return {}
    decoder_path = folder.path / str(folder.decoder.get("filename", "model.onnx"))
    try:
        graph = onnx.load(str(decoder_path), load_external_data=False).graph
    except Exception as exc:  # onnx raises its own untyped errors for missing or corrupt files
        raise ModelLoadError(f"{decoder_path} could not be read: {exc}", path=decoder_path) from exc
    inputs = {i.name for i in graph.input}
    # An adapter is smaller than the model it adapts: a larger file is no adapter, and is
    # refused before onnxruntime reads it whole.
    largest = sum(
        f.stat().st_size for f in folder.path.iterdir() if f.is_file() and f.name.startswith(decoder_path.name)
    )
    checked = {}
    for name, given in adapters.items():
        path = Path(given).expanduser().resolve()
        if not path.is_file():
            raise ModelLoadError(f"adapter {name!r}: {path} does not exist", path=path)
        size = path.stat().st_size
        if size > largest:
            raise ModelLoadError(
                f"adapter {name!r}: {path} is {size} bytes, larger than the model it would adapt ({largest} bytes)",
                path=path,
            )
        try:
            tensors = set(ort.AdapterFormat.read_adapter(str(path)).get_parameters())
        except Exception as exc:  # onnxruntime raises plain RuntimeErrors for bad files
            raise ModelLoadError(f"adapter {name!r}: {path} is not an .onnx_adapter file: {exc}", path=path) from exc
        unknown = sorted(tensors - inputs)
        if not tensors or unknown:
            raise ModelLoadError(
                f"adapter {name!r}: {path} was not made for {folder.path}: its decoder has no inputs "
                f"{', '.join(unknown[:3]) or '(the adapter is empty)'}{' ...' if len(unknown) > 3 else ''} "
                "(a base model with LoRA inputs is exported with the adapters, e.g. by Olive)",
                path=path,
            )
        checked[name] = path
    return checked
