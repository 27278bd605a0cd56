"""A GGUF file's decoder as the ONNX graph og's builder writes, weights streamed to disk.

The graph has the builder's shape, so that every engine drives it: ``input_ids``,
``attention_mask`` and one ``past_key_values.N.key/value`` per layer in, ``logits`` and
``present.N.key/value`` out, ``GroupQueryAttention`` with rotary embedding inside (the
share-buffer cache the ort-cpu engine writes in place), ``SimplifiedLayerNormalization``
and its skip form. Matrices are ``MatMulNBits`` over the file's own integers and scales
(:mod:`._gguf_weights`); the LM head is one node (the ort-cpu engine gathers the last
position in front of it), followed only by Gemma 2's final softcap (``Mul``, ``Tanh``,
``Mul``, as the builder writes it).

What differs between architectures is a short list (:mod:`._gguf_arch`): llama.cpp's
rotary style (``NORM``: adjacent pairs, which is how its converter permuted llama's
query/key rows; ``NEOX``: halves) and over how much of each head (part of it: Nemotron),
RMS norms or LayerNorms (``LayerNormalization``, ``SkipLayerNormalization``: with the
file's weight and bias on Nemotron, with ones and no bias on OLMo 1, as the builder writes
them), biases wherever the file has them (required on Qwen 2's query/key/value), OLMo 1's
clamp of queries, keys and values (``Clip``), norms of queries and keys per head (Qwen 3,
Gemma 3) or whole (OLMo 2), norms after the blocks (Gemma 2/3, OLMo 2) or none before them
(OLMo 2), fused matrices (Phi-3: cut into their parts, which go back together where they
share a form), the feed-forward's activation (SiLU, GELU, Nemotron's squared ReLU without a
gate), attention softcap and sliding windows (GroupQueryAttention's ``softcap`` and
``local_window_size``, the local layers with cos/sin caches of their own on Gemma 3), and
the scales of embeddings, residual adds, queries and logits (Gemma, Granite).

Weights are written tensor by tensor into ``model.onnx.data`` (page aligned, so
onnxruntime maps what it does not repack): peak memory stays near one tensor, not the model.

Long on purpose (over 600 lines): one decoder's graph, written in the order it runs; each
architecture's difference is a branch where that part is written, so that a block reads
whole beside llama.cpp's graph of it (``src/models/*.cpp``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ._gguf_arch import ARCHITECTURES, Architecture, Hyperparameters
from ._gguf_file import GgufTensor
from ._gguf_weights import PackedMatrix, _requantized, dequantize, pack_matrix
from ._names import GgufError

__all__ = ["write_graph"]


class _Initializers:
    """Tensors written one by one into the external data file, page aligned."""

    ALIGN = 4096

    def __init__(self, data_path: Path) -> None:
        self.location = data_path.name
        self.file: IO[bytes] = data_path.open("wb")  # closed by close(), after the last tensor
        self.tensors: list[TensorProto] = []

    def add(self, name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        if array.nbytes < 1024:  # small ones inline: no page for a norm's scale
            tensor.raw_data = array.tobytes()
        else:
            offset = self.file.tell()
            padding = -offset % self.ALIGN
            self.file.write(b"\0" * padding)
            offset += padding
            array.tofile(self.file)  # no copy of the tensor
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(array.nbytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
        self.tensors.append(tensor)
        return name

    def close(self) -> None:
        self.file.close()


class _Graph:
    """Nodes, initializers and names: the builder's vocabulary, kept short."""

    def __init__(self, weights: _Initializers, accuracy_level: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.weights = weights
        self.accuracy_level = accuracy_level
        self.exact = True
        self.types: dict[str, int] = {}

    def node(
        self, op: str, inputs: list[str], name: str, outputs: int = 1, domain: str = "", **attrs: Any
    ) -> list[str]:
        names = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=name, domain=domain or None, **attrs))
        return names

    def constant(self, name: str, array: np.ndarray) -> str:
        return self.weights.add(name, array)

    def linear(self, x: str, matrix: PackedMatrix, name: str, output: str | None = None) -> str:
        """``x @ W^T`` (plus the per-block offsets' correction where the type has a minimum).

        Activations are quantized to int8 per block (``accuracy_level`` 4, as llama.cpp's
        q8 dot products) except on 4-bit blocks of 16 (Q2_K), where onnxruntime 1.31's int8
        path was measured wrong (logit errors of 2.4 against 5e-5 in float). Measured on
        this path's choices (AVX2, one row): 4-bit 52 us against 109 us in float, 8-bit
        53 us against 1,530 us; SmolLM2's perplexity within 0.8% of llama.cpp's on every
        type. Float 4-bit is closer to exact arithmetic than either (first-token logprobs
        0.02 from float64, llama.cpp 0.13, int8 here 0.24) at twice the matmul time.
        """
        self.exact &= matrix.exact
        out = output or f"{name}/output_0"
        if matrix.dense is not None:
            weight = self.constant(f"{name}.weight", matrix.dense)
            self.nodes.append(helper.make_node("MatMul", [x, weight], [out], name=name))
            return out
        assert matrix.codes is not None and matrix.scales is not None
        codes = self.constant(f"{name}.qweight", matrix.codes)
        scales = self.constant(f"{name}.scales", matrix.scales)
        product = out if matrix.offsets is None else f"{name}/product"
        self.nodes.append(
            helper.make_node(
                "MatMulNBits",
                [x, codes, scales],
                [product],
                name=name,
                domain="com.microsoft",
                K=matrix.in_features,
                N=matrix.out_features,
                bits=matrix.bits,
                block_size=matrix.block_size,
                accuracy_level=0 if matrix.bits == 4 and matrix.block_size < 32 else self.accuracy_level,
            )
        )
        if matrix.offsets is None:
            return out
        sums = self.block_sums(x, matrix.in_features, matrix.block_size)
        offsets = self.constant(f"{name}.offsets", matrix.offsets)
        (correction,) = self.node("MatMul", [sums, offsets], f"{name}/offsets")
        self.nodes.append(helper.make_node("Add", [product, correction], [out], name=f"{name}/add"))
        return out

    def embedding(self, table: PackedMatrix, ids: str) -> str:
        """Rows of ``table`` for the token ``ids``: ``GatherBlockQuantized`` over the file's
        own blocks (the table stays as small as in the file: SmolLM2's Q8_0 one 28 MB, not
        113 MB in float), the per-block minimums gathered and added where the type has them."""
        name = "/embed"
        if table.dense is not None:
            weight = self.constant("token_embd.weight", np.ascontiguousarray(table.dense.T))
            return self.node("Gather", [weight, ids], name)[0]
        assert table.codes is not None and table.scales is not None
        self.exact &= table.exact
        rows, width = table.out_features, table.in_features
        blocks = width // table.block_size
        codes = self.constant("token_embd.qweight", table.codes.reshape(rows, -1))
        scales = self.constant("token_embd.scales", table.scales.reshape(rows, blocks))
        (gathered,) = self.node(
            "GatherBlockQuantized",
            [codes, ids, scales],
            name,
            domain="com.microsoft",
            bits=table.bits,
            block_size=table.block_size,
            gather_axis=0,
            quantize_axis=1,
        )
        if table.offsets is None:
            return gathered
        offsets = self.constant("token_embd.offsets", np.ascontiguousarray(table.offsets.T))  # (rows, blocks)
        (minimums,) = self.node("Gather", [offsets, ids], f"{name}/offsets")
        (column,) = self.node(
            "Unsqueeze", [minimums, self.constant(f"{name}.axis", np.array([-1], np.int64))], f"{name}/offsets_column"
        )
        repeat = self.constant(f"{name}.repeat", np.array([1, 1, 1, table.block_size], np.int64))
        (spread,) = self.node("Tile", [column, repeat], f"{name}/offsets_spread")
        shape = self.constant(f"{name}.shape", np.array([0, 0, width], np.int64))
        (flat,) = self.node("Reshape", [spread, shape], f"{name}/offsets_flat")
        return self.node("Add", [gathered, flat], f"{name}/add")[0]

    def block_sums(self, x: str, width: int, block: int) -> str:
        """Sums of ``x`` over each block of ``block`` features (shared by the matrices that
        read the same input with the same blocks)."""
        key = f"{x}/sums{block}"
        if key not in self.types:
            shape = self.constant(f"{key}.shape", np.array([0, 0, width // block, block], np.int64))
            (blocks,) = self.node("Reshape", [x, shape], f"{key}/reshape")
            axes = self.constant(f"{key}.axes", np.array([-1], np.int64))
            self.node("ReduceSum", [blocks, axes], key, keepdims=0)
            self.types[key] = 0
        return f"{key}/output_0"


def _fused(matrices: list[PackedMatrix]) -> PackedMatrix | None:
    """Query, key and value as one matrix (one kernel call) where they share a form."""
    first = matrices[0]
    if any(
        m.bits != first.bits
        or m.block_size != first.block_size
        or (m.dense is None) != (first.dense is None)
        or not m.exact
        for m in matrices
    ):
        return None
    out = sum(m.out_features for m in matrices)
    if first.dense is not None:
        return PackedMatrix(out, first.in_features, dense=np.concatenate([m.dense for m in matrices], axis=1))
    offsets = None
    if any(m.offsets is not None for m in matrices):
        blocks = first.in_features // first.block_size
        offsets = np.concatenate(
            [m.offsets if m.offsets is not None else np.zeros((blocks, m.out_features), np.float32) for m in matrices],
            axis=1,
        )
    return PackedMatrix(
        out,
        first.in_features,
        bits=first.bits,
        block_size=first.block_size,
        codes=np.concatenate([m.codes for m in matrices]),
        scales=np.concatenate([m.scales for m in matrices]),
        offsets=offsets,
    )


def _rotary_caches(
    params: Hyperparameters, rope_factors: np.ndarray | None, *, local: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches (positions x rotary_dim/2) as llama.cpp computes its rotation angles;
    ``local``: those of the sliding-window layers where they have a base of their own
    (Gemma 3: 10000, unscaled)."""
    half = params.rotary_dim // 2
    base = params.local_rope_base if local else params.rope_base
    inv_freq = 1.0 / (base ** (np.arange(0, half, dtype=np.float64) * 2 / params.rotary_dim))
    if rope_factors is not None and not local:
        inv_freq = inv_freq / rope_factors.astype(np.float64)[:half]
    positions = np.arange(params.context_length, dtype=np.float64)
    if params.rope_scaling == "linear" and not local:
        positions = positions / params.rope_factor
    angles = np.outer(positions, inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def write_graph(
    reader_tensors: Sequence[GgufTensor],
    fields: Mapping[str, Any],
    folder: Path,
    progress: Callable[[float], None] = lambda fraction: None,
    *,
    accuracy_level: int = 4,
) -> tuple[Hyperparameters, dict[str, Any]]:
    """Write ``model.onnx`` and ``model.onnx.data`` of the decoder the GGUF ``fields`` and
    ``reader_tensors`` (every part's, for a split file) describe into ``folder``; returns
    the hyperparameters and a summary (types, whether every weight is exact)."""
    tensors = {t.name: t for t in reader_tensors}
    params = Hyperparameters.read(fields, tensors)
    arch = ARCHITECTURES[params.architecture]
    weights = _Initializers(folder / "model.onnx.data")
    graph = _Graph(weights, accuracy_level)
    try:
        _write_nodes(graph, params, arch, tensors, progress)
    finally:
        weights.close()
    kv_shape: list[str | int | None] = ["batch_size", params.kv_heads, "past_sequence_length", params.head_size]
    present_shape: list[str | int | None] = ["batch_size", params.kv_heads, "total_sequence_length", params.head_size]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", params.vocab_size])
    ]
    for i in range(params.layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present_shape))
    model = helper.make_model(
        helper.make_graph(graph.nodes, "decoder", inputs, outputs, weights.tensors),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        producer_name="ortserve-gguf",
        ir_version=10,
    )
    onnx.save(model, str(folder / "model.onnx"))
    types: dict[str, int] = {}
    for tensor in reader_tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return params, {"tensor_types": types, "exact": graph.exact}


def _write_nodes(
    graph: _Graph,
    params: Hyperparameters,
    arch: Architecture,
    tensors: Mapping[str, GgufTensor],
    progress: Callable[[float], None],
) -> None:
    weights = _Weights(graph, params, arch, tensors, progress)
    # attention_mask -> what GroupQueryAttention takes: each row's last position and the width.
    one = graph.constant("/constants/one", np.array([1], np.int64))
    (mask_sum,) = graph.node("ReduceSum", ["attention_mask", one], "/mask/sum", keepdims=0)
    (last,) = graph.node("Sub", [mask_sum, one], "/mask/last")
    (seqlens_k,) = graph.node("Cast", [last], "/mask/seqlens_k", to=TensorProto.INT32)
    (shape,) = graph.node("Shape", ["attention_mask"], "/mask/shape")
    (width,) = graph.node("Gather", [shape, one], "/mask/width", axis=0)
    (total_length,) = graph.node("Cast", [width], "/mask/total", to=TensorProto.INT32)
    factors = tensors.get("rope_freqs.weight")
    factor_values = dequantize(factors.data, factors.tensor_type, (-1,)) if factors else None
    cos, sin = _rotary_caches(params, factor_values)
    caches = {False: (graph.constant("cos_cache", cos), graph.constant("sin_cache", sin))}
    caches[True] = caches[False]
    if params.local_rope_base and any(params.local_layers):  # Gemma 3's local layers: a rotation of their own
        cos, sin = _rotary_caches(params, factor_values, local=True)
        caches[True] = (graph.constant("cos_cache_local", cos), graph.constant("sin_cache_local", sin))

    embedding = weights.tensor("token_embd.weight")
    _check_shape(embedding, (params.hidden, params.vocab_size))
    hidden = graph.embedding(
        pack_matrix(embedding.data, embedding.tensor_type, params.vocab_size, params.hidden), "input_ids"
    )
    if params.embedding_scale != 1.0:
        scale = graph.constant("/embed/scale", np.array(params.embedding_scale, np.float32))
        (hidden,) = graph.node("Mul", [hidden, scale], "/embed/scaled")
    # The residual stream is ``residual + pending``: the skip norms add the pending output.
    residual, pending = hidden, ""
    for i in range(params.layers):
        prefix = f"blk.{i}"
        normed, residual = weights.pre_norm(residual, pending, f"{prefix}.attn_norm")
        query, key, value = _attention_inputs(graph, weights, arch, params, normed, prefix)
        attributes: dict[str, Any] = {}
        if params.attention_softcap:
            attributes["softcap"] = params.attention_softcap
        if params.local_layers[i]:  # the position itself and window - 1 before it, as llama.cpp's (measured)
            attributes["local_window_size"] = params.window
        cos_cache, sin_cache = caches[params.local_layers[i]]
        attention, _, _ = graph.node(
            "GroupQueryAttention",
            [
                query,
                key,
                value,
                f"past_key_values.{i}.key",
                f"past_key_values.{i}.value",
                seqlens_k,
                total_length,
                cos_cache,
                sin_cache,
            ],
            f"/{prefix}/attn",
            outputs=3,
            domain="com.microsoft",
            num_heads=params.heads,
            kv_num_heads=params.kv_heads,
            scale=params.attention_scale,
            do_rotary=1,
            rotary_interleaved=int(arch.rope_interleaved),
            **attributes,
        )
        graph.nodes[-1].output[1:] = [f"present.{i}.key", f"present.{i}.value"]
        q_size = params.heads * params.head_size
        out = graph.linear(
            attention, weights.matrix(f"{prefix}.attn_output.weight", params.hidden, q_size), f"/{prefix}/attn_output"
        )
        out = weights.biased(out, f"{prefix}.attn_output", params.hidden)
        pending = weights.post_norm(out, f"{prefix}.post_attention_norm")
        normed, residual = weights.pre_norm(residual, pending, f"{prefix}.ffn_norm")
        product = _feed_forward_inner(graph, arch, params, normed, prefix, weights)
        out = graph.linear(
            product,
            weights.matrix(f"{prefix}.ffn_down.weight", params.hidden, params.feed_forward),
            f"/{prefix}/ffn_down",
        )
        out = weights.biased(out, f"{prefix}.ffn_down", params.hidden)
        pending = weights.post_norm(out, f"{prefix}.post_ffw_norm")
    # Granite's logits are divided by its logit scale: folded into the last norm's weights.
    (normed,) = graph.node(
        "SkipSimplifiedLayerNormalization" if arch.norm == "rms" else "SkipLayerNormalization",
        [residual, pending, *weights.norm_parameters("output_norm", params.logit_scale)],
        "/output_norm",
        domain="com.microsoft",
        epsilon=params.epsilon,
    )
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied embeddings
    head = weights.matrix(head_name, params.vocab_size, params.hidden)
    if head.offsets is not None:
        # One node writes the logits (the ort-cpu engine gathers the last position in front
        # of it): a type with minimums is requantized to 8 bits here.
        t = weights.tensor(head_name)
        head = _requantized(dequantize(t.data, t.tensor_type, (params.vocab_size, params.hidden)))
    if not params.final_softcap:
        graph.linear(normed, head, "/lm_head", output="logits")
        return
    # Gemma 2: cap * tanh(logits / cap), as llama.cpp orders it.
    logits = graph.linear(normed, head, "/lm_head")
    inverse = graph.constant("/softcap/inverse", np.array(1 / params.final_softcap, np.float32))
    (scaled,) = graph.node("Mul", [logits, inverse], "/softcap/scale")
    (bent,) = graph.node("Tanh", [scaled], "/softcap/tanh")
    cap = graph.constant("/softcap/cap", np.array(params.final_softcap, np.float32))
    graph.nodes.append(helper.make_node("Mul", [bent, cap], ["logits"], name="/softcap/mul"))


class _Weights:
    """The file's tensors as the graph's matrices and norms, progress counted by bytes read."""

    def __init__(
        self,
        graph: _Graph,
        params: Hyperparameters,
        arch: Architecture,
        tensors: Mapping[str, GgufTensor],
        progress: Callable[[float], None],
    ) -> None:
        self.graph, self.params, self.arch, self.tensors, self.progress = graph, params, arch, tensors, progress
        self.total = sum(int(t.n_bytes) for t in tensors.values()) or 1
        self.done = 0

    def tensor(self, name: str) -> GgufTensor:
        found = self.tensors.get(name)
        if found is None:
            raise GgufError(f"the file lacks the tensor {name}")
        return found

    def matrix(self, name: str, out_features: int, in_features: int) -> PackedMatrix:
        return self.rows(name, [out_features], in_features)[0]

    def rows(self, name: str, parts: list[int], in_features: int) -> list[PackedMatrix]:
        """The matrix ``name`` cut into consecutive blocks of ``parts`` rows (output
        features): fused query/key/value or gate/up matrices as the separate ones."""
        t = self.tensor(name)
        _check_shape(t, (in_features, sum(parts)))
        row_bytes = t.n_bytes // sum(parts)
        matrices, start = [], 0
        for count in parts:
            data = t.data[start * row_bytes : (start + count) * row_bytes]
            matrices.append(pack_matrix(data, t.tensor_type, count, in_features))
            start += count
        self.done += t.n_bytes
        self.progress(self.done / self.total)
        return matrices

    def vector(self, name: str, size: int) -> np.ndarray:
        t = self.tensor(name)
        _check_shape(t, (size,))
        return dequantize(t.data, t.tensor_type, (size,))

    def biased(self, x: str, name: str, size: int) -> str:
        """``x`` plus the file's ``name.bias`` (``size`` values) where it has one: llama.cpp
        adds every projection's bias it finds, and refuses a file with tensors it does not read."""
        if f"{name}.bias" not in self.tensors:
            return x
        bias = self.graph.constant(f"{name}.bias", self.vector(f"{name}.bias", size))
        return self.graph.node("Add", [x, bias], f"{_node_name(name)}/bias")[0]

    def norm_parameters(self, name: str, divisor: float = 1.0) -> list[str]:
        """The scale (and bias) of the block norm ``name`` as the architecture's norm takes
        them, divided by ``divisor``: the file's weight (and bias, for LayerNorm), or ones
        where its LayerNorms have none (OLMo 1, as og's builder writes them)."""
        size = self.params.hidden
        if self.arch.norm == "plain":
            values = [np.ones(size, np.float32)]
        else:
            values = [self.vector(f"{name}.weight", size)]
            if self.arch.norm == "layer":
                values.append(self.vector(f"{name}.bias", size))
        return [
            self.graph.constant(f"{name}.{kind}", value / np.float32(divisor))
            for kind, value in zip(("weight", "bias"), values, strict=False)
        ]

    def block_norm(self, x: str, name: str) -> str:
        """The architecture's norm of the residual stream ``x`` by the parameters ``name``."""
        if self.arch.norm == "rms":
            return self.norm(x, name, self.params.hidden)
        return self.graph.node(
            "LayerNormalization",
            [x, *self.norm_parameters(name)],
            _node_name(name),
            epsilon=self.params.epsilon,
            axis=-1,
            stash_type=1,
        )[0]

    def norm(self, x: str, name: str, size: int) -> str:
        """RMS norm of ``x`` by the file's ``name.weight`` (``size`` values)."""
        weight = self.graph.constant(f"{name}.weight", self.vector(f"{name}.weight", size))
        return self.graph.node(
            "SimplifiedLayerNormalization",
            [x, weight],
            _node_name(name),
            epsilon=self.params.epsilon,
            axis=-1,
            stash_type=1,
        )[0]

    def pre_norm(self, residual: str, pending: str, name: str) -> tuple[str, str]:
        """The residual stream with ``pending`` added, and its norm by ``name`` (the block's
        input); OLMo 2's blocks take the stream as it is."""
        if not self.arch.pre_norms:
            if pending:
                (residual,) = self.graph.node("Add", [residual, pending], f"{_node_name(name)}/residual")
            return residual, residual
        if not pending:
            return self.block_norm(residual, name), residual
        normed, _, _, residual = self.graph.node(
            "SkipSimplifiedLayerNormalization" if self.arch.norm == "rms" else "SkipLayerNormalization",
            [residual, pending, *self.norm_parameters(name)],
            _node_name(name),
            outputs=4,
            domain="com.microsoft",
            epsilon=self.params.epsilon,
        )
        return normed, residual

    def post_norm(self, out: str, name: str) -> str:
        """A block's output as the residual stream adds it: normed (Gemma 2/3, OLMo 2) and
        scaled (Granite)."""
        if self.arch.post_norms:
            out = self.block_norm(out, name)
        if self.params.residual_scale != 1.0:
            scale = self.graph.constant(f"{_node_name(name)}/scale", np.array(self.params.residual_scale, np.float32))
            (out,) = self.graph.node("Mul", [out, scale], f"{_node_name(name)}/scaled")
        return out


def _attention_inputs(
    graph: _Graph, weights: _Weights, arch: Architecture, params: Hyperparameters, normed: str, prefix: str
) -> tuple[str, str, str]:
    """GroupQueryAttention's query, key and value inputs (one packed input and two empty
    names where one matrix computes all three)."""
    q_size, kv_size = params.heads * params.head_size, params.kv_heads * params.head_size
    if f"{prefix}.attn_qkv.weight" in weights.tensors:  # Phi-3: one matrix in the file
        q, k, v = weights.rows(f"{prefix}.attn_qkv.weight", [q_size, kv_size, kv_size], params.hidden)
    else:
        q = weights.matrix(f"{prefix}.attn_q.weight", q_size, params.hidden)
        k = weights.matrix(f"{prefix}.attn_k.weight", kv_size, params.hidden)
        v = weights.matrix(f"{prefix}.attn_v.weight", kv_size, params.hidden)
    if arch.qkv_bias:  # Qwen 2's are not optional
        for n in "qkv":
            weights.tensor(f"{prefix}.attn_{n}.bias")
    biases = any(f"{prefix}.attn_{n}.bias" in weights.tensors for n in "qkv")
    fused = None if biases or arch.qk_norm else _fused([q, k, v])
    if fused is not None:
        packed = graph.linear(normed, fused, f"/{prefix}/attn_qkv")
        return _clamped(graph, params, packed, f"/{prefix}/attn_qkv"), "", ""
    query, key, value = (
        _clamped(
            graph,
            params,
            weights.biased(graph.linear(normed, m, f"/{prefix}/attn_{n}"), f"{prefix}.attn_{n}", size),
            f"/{prefix}/attn_{n}",
        )
        for m, n, size in ((q, "q", q_size), (k, "k", kv_size), (v, "v", kv_size))
    )
    if arch.qk_norm == "whole":  # OLMo 2: over the whole projection
        query = weights.norm(query, f"{prefix}.attn_q_norm", q_size)
        key = weights.norm(key, f"{prefix}.attn_k_norm", kv_size)
    elif arch.qk_norm:  # each head's slice
        query, key = (
            _head_norm(
                graph,
                x,
                weights.vector(f"{prefix}.attn_{n}_norm.weight", params.head_size),
                f"/{prefix}/attn_{n}_norm",
                params,
            )
            for x, n in ((query, "q"), (key, "k"))
        )
    return query, key, value


def _clamped(graph: _Graph, params: Hyperparameters, x: str, name: str) -> str:
    """``x`` clamped to +-``clamp_kqv`` where the file sets one (OLMo 1's ``clip_qkv``)."""
    if not params.clamp_kqv:
        return x
    low = graph.constant(f"{name}/clamp_low", np.array(-params.clamp_kqv, np.float32))
    high = graph.constant(f"{name}/clamp_high", np.array(params.clamp_kqv, np.float32))
    return graph.node("Clip", [x, low, high], f"{name}/clamp")[0]


def _feed_forward_inner(
    graph: _Graph,
    arch: Architecture,
    params: Hyperparameters,
    normed: str,
    prefix: str,
    weights: _Weights,
) -> str:
    """The feed-forward before its down projection: ``act(gate) * up`` (gated), or
    ``act(up)`` (Nemotron)."""
    ff, hidden = params.feed_forward, params.hidden
    gate_matrix: PackedMatrix | None
    if arch.fused_gate_up:  # Phi-3: the gate's rows, then up's, in ffn_up
        gate_matrix, up_matrix = weights.rows(f"{prefix}.ffn_up.weight", [ff, ff], hidden)
    else:
        gate_matrix = weights.matrix(f"{prefix}.ffn_gate.weight", ff, hidden) if arch.gated else None
        up_matrix = weights.matrix(f"{prefix}.ffn_up.weight", ff, hidden)
    gate = ""
    if gate_matrix is not None:
        gate = weights.biased(graph.linear(normed, gate_matrix, f"/{prefix}/ffn_gate"), f"{prefix}.ffn_gate", ff)
    up = weights.biased(graph.linear(normed, up_matrix, f"/{prefix}/ffn_up"), f"{prefix}.ffn_up", ff)
    x = gate or up
    if arch.activation == "gelu":
        (activated,) = graph.node("Gelu", [x], f"/{prefix}/ffn_gelu", approximate="tanh")
    elif arch.activation == "relu2":
        (relu,) = graph.node("Relu", [x], f"/{prefix}/ffn_relu")
        (activated,) = graph.node("Mul", [relu, relu], f"/{prefix}/ffn_relu2")
    else:
        (sigmoid,) = graph.node("Sigmoid", [x], f"/{prefix}/ffn_sigmoid")
        (activated,) = graph.node("Mul", [x, sigmoid], f"/{prefix}/ffn_silu")
    if not gate:
        return activated
    return graph.node("Mul", [activated, up], f"/{prefix}/ffn_product")[0]


def _head_norm(graph: _Graph, x: str, weight: np.ndarray, name: str, params: Hyperparameters) -> str:
    """RMS norm of each head's slice (Qwen 3's query and key norms)."""
    shape = graph.constant(f"{name}.shape", np.array([0, 0, -1, params.head_size], np.int64))
    (heads,) = graph.node("Reshape", [x, shape], f"{name}/split")
    (normed,) = graph.node(
        "SimplifiedLayerNormalization",
        [heads, graph.constant(f"{name}.weight", weight)],
        name,
        epsilon=params.epsilon,
        axis=-1,
        stash_type=1,
    )
    flat = graph.constant(f"{name}.flat", np.array([0, 0, -1], np.int64))
    return graph.node("Reshape", [normed, flat], f"{name}/join")[0]


def _node_name(tensor: str) -> str:
    """A node's name from its weight's: ``blk.0.attn_norm`` -> ``/blk.0/attn_norm``."""
    return "/" + "/".join(tensor.rsplit(".", 1)) if tensor.startswith("blk.") else f"/{tensor}"


def _check_shape(tensor: GgufTensor, expected: tuple[int, ...]) -> None:
    """A tensor's dimensions (ggml order: fastest first) as the hyperparameters say."""
    shape = tuple(int(d) for d in tensor.shape)
    if shape != expected:
        raise GgufError(f"tensor {tensor.name} has shape {list(shape)}, the header implies {list(expected)}")
