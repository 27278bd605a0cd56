"""An int8 copy of an int4 decoder graph for prefill: ``MatMulNBits`` (int4 weights,
dequantised block by block) becomes ``DynamicQuantizeMatMul`` (int8 weights, one scale per
output column, activations quantised per call), onnxruntime's u8s8 GEMM.

Why: a prompt's prefill multiplies hundreds of rows at once and is bound by arithmetic.
onnxruntime's int4 kernels (accuracy level 4, int8 activations per block) reach a third of
what its u8s8 GEMM does on the same matrices with AVX-512 VNNI (measured, 0.5B-shaped
model: 2.8-2.9x on a 512 x 896 x 4864 product, 1.45x slower on one row). So the engine
prefills with this graph and decodes with the folder's own; both write the same
key/value cache (attention runs on the same GroupQueryAttention kernel in both).

The price: the int8 weights are twice the int4 ones in memory, and rounding the weights per
column and the activations per call (rather than per block of 32) moves logits a little,
so greedy tokens can differ from the int4 graph's (measured in benchmarks/bench_prefill.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnx.helper
import onnx.numpy_helper

__all__ = ["cpu_has_vnni", "has_int4_matrices", "int8_prefill_graph"]

KEEP_INT4 = ("down_proj",)
"""Matrices left on the int4 kernel (matched in the node's name, the genai builder's
naming): the MLP's down projection multiplies SiLU(gate) x up, whose few huge values leave
one scale per call too coarse for the rest. Measured on SmolLM2-135M, 8 chat replies of 32
greedy tokens against the int4 prefill's: every matrix in int8, 1 equal and the first
difference after 3.1 tokens on average (1.59x faster at 1,024 tokens); down_proj kept,
2 equal, 14.4 tokens (1.45x); only gate and up in int8, 4 equal, 15.6 tokens (1.28x)."""

MAX_PROTO_BYTES = 1_800_000_000
"""The int8 weights live inside the graph's protobuf, which cannot exceed 2 GB."""


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


def int8_prefill_graph(graph_model: onnx.ModelProto, folder: Path) -> onnx.ModelProto | None:
    """A copy of ``graph_model`` (its external data in ``folder``) with each 4-bit
    ``MatMulNBits`` replaced as the module says, or ``None`` where there is none to replace
    or the weights would not fit in one protobuf."""
    model = onnx.ModelProto()
    model.CopyFrom(graph_model)
    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    replaced: dict[str, onnx.TensorProto] = {}
    total = 0
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
        replaced[name + "/weight"] = onnx.numpy_helper.from_array(quantized, name + "/weight")
        replaced[name + "/scale"] = onnx.numpy_helper.from_array(column_scale, name + "/scale")
        total += quantized.nbytes
        if total > MAX_PROTO_BYTES:
            return None
        new_inputs = [node.input[0], name + "/weight", name + "/scale"] + (["", bias] if bias else [])
        new = onnx.helper.make_node(
            "DynamicQuantizeMatMul", new_inputs, list(node.output), name=name, domain="com.microsoft"
        )
        graph.node.remove(node)
        graph.node.insert(index, new)
    if not replaced:
        return None
    used = {name for node in graph.node for name in node.input}
    kept = [tensor for tensor in graph.initializer if tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.extend(replaced.values())
    return model


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
