"""LoRA adapters: ``.onnx_adapter`` files checked against the decoder graph that takes them.

An adapter file (onnxruntime's format: what ``og.Adapters.load`` and
``onnxruntime.LoraAdapter`` read) holds tensors named after inputs of the decoder graph,
whose defaults (initializers) give the base model. Checked once at load, so that a wrong
file is a load error naming it rather than a failure of every request that picks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
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
    inputs = {i.name: i.type.tensor_type for i in graph.input}
    # An adapter is smaller than the model it adapts: a larger file is no adapter, and is
    # refused before onnxruntime reads it whole.
    largest = sum(
        f.stat().st_size for f in folder.path.iterdir() if f.is_file() and f.name.startswith(decoder_path.name)
    )
    checked = {}
    for name, given in adapters.items():
        path = Path(given).expanduser().resolve()
        if not path.is_file():  # named as given: a link's target (/proc/PID/...) is no caller's business
            what = "is not a regular file" if path.exists() else "does not exist"
            raise ModelLoadError(f"adapter {name!r}: {given} {what}", path=path)
        size = path.stat().st_size
        if size > largest:
            raise ModelLoadError(
                f"adapter {name!r}: {path} is {size} bytes, larger than the model it would adapt ({largest} bytes)",
                path=path,
            )
        try:
            # The OrtValues own the memory: ``numpy()`` is a view that keeps no reference to
            # its value, so they are held while the views are read (dropped at once, the
            # check read freed memory and saw NaN in a good file, now and then).
            values = ort.AdapterFormat.read_adapter(str(path)).get_parameters()
            tensors = {k: v.numpy() for k, v in values.items()}
        except Exception as exc:  # onnxruntime raises plain RuntimeErrors for bad files
            raise ModelLoadError(f"adapter {name!r}: {path} is not an .onnx_adapter file: {exc}", path=path) from exc
        unknown = sorted(set(tensors) - set(inputs))
        if not tensors or unknown:
            raise ModelLoadError(
                f"adapter {name!r}: {path} was not made for {folder.path}: its decoder has no inputs "
                f"{', '.join(unknown[:3]) or '(the adapter is empty)'}{' ...' if len(unknown) > 3 else ''} "
                "(a base model with LoRA inputs is exported with the adapters, e.g. by Olive)",
                path=path,
            )
        wrong = _mismatch(tensors, inputs)
        if wrong is not None:
            raise ModelLoadError(f"adapter {name!r}: {path} was not made for {folder.path}: {wrong}", path=path)
        checked[name] = path
    return checked


def _mismatch(tensors: Mapping[str, np.ndarray], inputs: Mapping[str, onnx.TypeProto.Tensor]) -> str | None:
    """What in an adapter's tensors the decoder's inputs would refuse (their element type,
    rank, fixed sizes, a named size such as ``lora_rank`` the same wherever it appears) or
    turn into NaN logits (values that are not finite); ``None`` when nothing. Before, such
    an adapter loaded and every request that picked it failed with a bare 500."""
    named: dict[str, tuple[int, str]] = {}
    for tensor_name, values in sorted(tensors.items()):
        wanted = inputs[tensor_name]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(wanted.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in wanted.shape.dim]
        shown = "[" + ", ".join(str(d) if d is not None else "?" for d in dims) + "]"
        said = f"its tensor {tensor_name} is {values.dtype} of shape {list(values.shape)}, the decoder takes {dtype} of shape {shown}"
        if values.dtype != dtype or values.ndim != len(dims):
            return said
        for size, dim in zip(values.shape, dims, strict=True):
            if isinstance(dim, int) and dim > 0 and size != dim:
                return said
            if isinstance(dim, str):
                first = named.setdefault(dim, (size, tensor_name))
                if first[0] != size:
                    return f"{said}, where {first[1]} has {dim} = {first[0]}"
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            return f"its tensor {tensor_name} holds values that are not finite (NaN or infinity)"
    return None
