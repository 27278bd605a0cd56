"""An int8 copy of an int4 decoder graph for prefill: ``MatMulNBits`` (int4 weights,
dequantised block by block) becomes ``DynamicQuantizeMatMul`` (int8 weights, one scale per
output column, activations quantised per call), onnxruntime's u8s8 GEMM.

Why: a prompt's prefill multiplies hundreds of rows at once and is bound by arithmetic.
onnxruntime's int4 kernels (accuracy level 4, int8 activations per block) reach a third of
what its u8s8 GEMM does on the same matrices with AVX-512 VNNI (measured, 0.5B-shaped
model: 2.8-2.9x on a 512 x 896 x 4864 product, 1.45x slower on one row). So the engine
prefills with this graph and decodes with the folder's own; both write the same
key/value cache (attention runs on the same GroupQueryAttention kernel in both).

The copy is written once to a folder under ``$ORTSERVE_CACHE/int8-prefill`` with all the
weights it needs in one file (onnxruntime reads external data only from the graph's own
folder and refuses links out of it; a hard link would trip onnx's own check on the model's
file), and onnxruntime maps it from there: the weights never pass through a protobuf, so
there is no 2 GB limit and no converted copy left on the heap (measured on the 0.5B-shaped
model: 880 MB more resident than the int4 model alone when the weights lived in the graph,
about 510 MB now), and the next load skips the conversion.

The price: the int8 weights are twice the int4 ones, and rounding the weights per column
and the activations per call (rather than per block of 32) moves logits a little, so greedy
tokens can differ from the int4 graph's (measured in benchmarks/bench_prefill.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt
import onnx
import onnx.helper
import onnx.numpy_helper

__all__ = [
    "cpu_has_vnni",
    "has_int4_matrices",
    "int8_cache",
    "int8_prefill_folder",
    "int8_prefill_graph",
    "model_cache_key",
    "ortserve_cache",
]

KEEP_INT4 = ("down_proj", "lm_head")
"""Matrices left on the int4 kernel (matched in the node's name, the genai builder's
naming). The MLP's down projection multiplies SiLU(gate) x up, whose few huge values leave
one scale per call too coarse for the rest. Measured on SmolLM2-135M, 8 chat replies of 32
greedy tokens against the int4 prefill's: every matrix in int8, 1 equal and the first
difference after 3.1 tokens on average (1.59x faster at 1,024 tokens); down_proj kept,
2 equal, 14.4 tokens (1.45x); only gate and up in int8, 4 equal, 15.6 tokens (1.28x).
The LM head multiplies one row a prompt (the engine computes the last position's logits
only): int8 would gain nothing there and cost 136 MB on a 0.5B model."""

FORMAT = 2
"""Part of the cache key: raise it when the conversion changes, so older copies are rebuilt."""

ALIGNMENT = 4096
"""Each tensor in the copy's data file starts on a page, so onnxruntime can map it."""

DATA_FILE = "model.onnx.data"
SOURCE_FILE = "source.txt"
"""The model file a copy was made from (a newer copy of the same file replaces it)."""


def ortserve_cache(name: str) -> Path:
    """``$ORTSERVE_CACHE/name`` (``~/.cache/ortserve`` when unset, as for the client's
    files): where what is derived from a model once is kept for its next loads."""
    return Path(os.environ.get("ORTSERVE_CACHE", Path.home() / ".cache" / "ortserve")) / name


def int8_cache() -> Path:
    """Where int8 copies are kept: ``$ORTSERVE_CACHE/int8-prefill``."""
    return ortserve_cache("int8-prefill")


def cpu_has_vnni() -> bool:
    """Whether the CPU multiplies int8 with VNNI (AVX-512 VNNI or AVX-VNNI), which the u8s8
    GEMM needs to beat the int4 kernels (Linux: /proc/cpuinfo; elsewhere unknown: False)."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def has_int4_matrices(graph_model: onnx.ModelProto) -> bool:
    """Whether :func:`int8_prefill_graph` has anything to convert (read from the graph alone)."""
    return any(_convertible(node) for node in graph_model.graph.node)


def _convertible(node: onnx.NodeProto) -> bool:
    """A 4-bit ``MatMulNBits`` without group indices, not one of :data:`KEEP_INT4`."""
    if node.op_type != "MatMulNBits" or node.domain != "com.microsoft" or any(k in node.name for k in KEEP_INT4):
        return False
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return attributes.get("bits", 4) == 4 and not (len(node.input) > 4 and node.input[4])


def int8_prefill_graph(graph_model: onnx.ModelProto, folder: Path, data_file: Path) -> onnx.ModelProto | None:
    """A copy of ``graph_model`` (its external data in ``folder``) with each 4-bit
    ``MatMulNBits`` replaced as the module says, its int8 weights and scales written to
    ``data_file`` (the graph names it as their external data, by file name); ``None`` where
    there is none to replace."""
    model = onnx.ModelProto()
    model.CopyFrom(graph_model)
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    added: list[onnx.TensorProto] = []
    with data_file.open("wb") as data:
        for index, node in enumerate(graph.node):
            if not _convertible(node):
                continue
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            inputs = list(node.input) + [""] * (6 - len(node.input))
            _, packed, scales, zero_points, _, bias = inputs[:6]
            if packed not in initializers or scales not in initializers:
                continue
            zero = initializers.get(zero_points) if zero_points else None
            if zero_points and zero is None:
                continue
            weights = _dequantize(
                onnx.numpy_helper.to_array(initializers[packed], str(folder)),
                onnx.numpy_helper.to_array(initializers[scales], str(folder)),
                None if zero is None else onnx.numpy_helper.to_array(zero, str(folder)),
                int(attributes["K"]),
                int(attributes["N"]),
                int(attributes["block_size"]),
            )
            column_scale = np.maximum(np.abs(weights).max(axis=0), 1e-12).astype(np.float32) / 127
            quantized = np.clip(np.rint(weights / column_scale), -127, 127).astype(np.int8)
            name = f"ortserve/int8/{node.name or index}"
            added.append(_write_external(data, data_file.name, quantized, name + "/weight"))
            added.append(_write_external(data, data_file.name, column_scale, name + "/scale"))
            new_inputs = [node.input[0], name + "/weight", name + "/scale"] + (["", bias] if bias else [])
            new = onnx.helper.make_node(
                "DynamicQuantizeMatMul", new_inputs, list(node.output), name=name, domain="com.microsoft"
            )
            graph.node.remove(node)
            graph.node.insert(index, new)
        if not added:
            return None
        used = {name for node in graph.node for name in node.input}
        kept = [tensor for tensor in graph.initializer if tensor.name in used]
        for tensor in kept:  # the int4 weights left, the embeddings, the norms: into the same file
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                _copy_external(tensor, folder, data, data_file.name)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.extend(added)
    return model


def _write_external(data: BinaryIO, location: str, array: npt.NDArray[np.generic], name: str) -> onnx.TensorProto:
    """``array`` appended to ``data`` on a page boundary, and a tensor naming it there."""
    tensor = onnx.TensorProto(name=name, data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
    tensor.dims.extend(array.shape)
    offset = _align(data)
    data.write(np.ascontiguousarray(array).tobytes())
    _point_at(tensor, location, offset, array.nbytes)
    return tensor


def _copy_external(tensor: onnx.TensorProto, folder: Path, data: BinaryIO, location: str) -> None:
    """The bytes of an external ``tensor`` (relative to ``folder``) appended to ``data``, and
    the tensor pointed there."""
    entries = {entry.key: entry.value for entry in tensor.external_data}
    source_offset, length = int(entries.get("offset", 0)), entries.get("length")
    offset = _align(data)
    with (folder / entries["location"]).open("rb") as source:
        source.seek(source_offset)
        remaining = int(length) if length is not None else None
        while remaining is None or remaining > 0:
            chunk = source.read(1 << 24 if remaining is None else min(remaining, 1 << 24))
            if not chunk:
                break
            data.write(chunk)
            remaining = None if remaining is None else remaining - len(chunk)
    _point_at(tensor, location, offset, data.tell() - offset)


def _align(data: BinaryIO) -> int:
    data.write(b"\0" * (-data.tell() % ALIGNMENT))
    return data.tell()


def _point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def int8_prefill_folder(model_path: Path, graph_model: onnx.ModelProto, cache: Path) -> Path | None:
    """The folder under ``cache`` holding the int8 copy of ``model_path`` (its graph as
    ``graph_model``): ``model.onnx`` and its weights in :data:`DATA_FILE`; built here
    unless an earlier load left it, removing copies made of an earlier state of the same
    model file. ``None`` where there is nothing to convert. Raises ``OSError`` where
    ``cache`` cannot be written."""
    target = cache / model_cache_key(model_path, graph_model, f"{FORMAT} {KEEP_INT4}")
    if (target / "model.onnx").is_file():  # written last: the copy is whole
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    source = str(model_path.resolve())
    try:
        converted = int8_prefill_graph(graph_model, model_path.parent, partial / DATA_FILE)
        if converted is None:
            return None
        (partial / SOURCE_FILE).write_text(source, encoding="utf-8")
        onnx.save(converted, str(partial / "model.onnx"))
        with contextlib.suppress(OSError):  # another process finished it first: theirs is as good
            partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    for other in cache.iterdir():  # the model changed since: those copies would never be read again
        if other != target and not other.name.startswith(".") and _source_of(other) == source:
            shutil.rmtree(other, ignore_errors=True)  # a process still using one keeps its open files
    return target if (target / "model.onnx").is_file() else None


def _source_of(copy: Path) -> str | None:
    try:
        return (copy / SOURCE_FILE).read_text(encoding="utf-8")
    except OSError:
        return None


def _external_locations(model: onnx.ModelProto) -> set[str]:
    return {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }


def model_cache_key(model_path: Path, graph_model: onnx.ModelProto, derivation: str) -> str:
    """A name for what was derived from the model at ``model_path`` (graph ``graph_model``)
    as ``derivation`` says: the model folder's name and a digest of ``derivation``, the
    graph, and its weight files' sizes and modification times (a changed model or a
    changed derivation gets a new name)."""
    digest = hashlib.sha256(derivation.encode())
    digest.update(graph_model.SerializeToString())
    for location in sorted(_external_locations(graph_model)):
        stat = (model_path.parent / location).stat()
        digest.update(f"{location} {stat.st_size} {stat.st_mtime_ns}".encode())
    return f"{model_path.parent.name}-{digest.hexdigest()[:16]}"


def _dequantize(
    packed: npt.NDArray[np.uint8],
    scales: npt.NDArray[np.floating],
    zero_points: npt.NDArray[np.generic] | None,
    k: int,
    n: int,
    block_size: int,
) -> npt.NDArray[np.float32]:
    """The (K, N) float weights of a 4-bit ``MatMulNBits``: B is (N, blocks, block_size / 2)
    bytes, low nibble first; scales (N x blocks); zero points packed two to a byte (uint8),
    one a block (float), or 8 when absent."""
    blocks = packed.shape[1]
    packed = packed.reshape(n, blocks, block_size // 2)
    values = np.empty((n, blocks, block_size), np.float32)
    values[..., 0::2] = packed & 0x0F
    values[..., 1::2] = packed >> 4
    scale = scales.astype(np.float32).reshape(n, blocks, 1)
    if zero_points is None:
        zero: npt.NDArray[np.float32] = np.full((n, blocks, 1), 8, np.float32)
    elif zero_points.dtype == np.uint8:
        nibbles = zero_points.astype(np.uint8).reshape(n, -1)
        both = np.empty((n, nibbles.shape[1] * 2), np.float32)
        both[:, 0::2] = nibbles & 0x0F
        both[:, 1::2] = nibbles >> 4
        zero = both[:, :blocks].reshape(n, blocks, 1)
    else:
        zero = zero_points.astype(np.float32).reshape(n, blocks, 1)
    dequantized = ((values - zero) * scale).reshape(n, blocks * block_size)[:, :k]
    return np.ascontiguousarray(dequantized.T)
