"""A GGUF file's decoder as the ONNX graph og's builder writes, weights streamed to disk.

The graph has the builder's shape, so that every engine drives it: ``input_ids``,
``attention_mask`` and one ``past_key_values.N.key/value`` per layer in, ``logits`` and
``present.N.key/value`` out, ``GroupQueryAttention`` with rotary embedding inside (the
share-buffer cache the ort-cpu engine writes in place), ``SimplifiedLayerNormalization``
and its skip form. Matrices are ``MatMulNBits`` over the file's own integers and scales
(:mod:`._gguf_weights`); the LM head is one node (the ort-cpu engine gathers the last
position in front of it).

What differs between architectures is a short list (:class:`Architecture`): llama.cpp's
rotary style (``NORM``: adjacent pairs, which is how its converter permuted llama's
query/key rows; ``NEOX``: halves), biases on the query/key/value projections (Qwen 2),
per-head norms of queries and keys (Qwen 3).

Weights are written tensor by tensor into ``model.onnx.data`` (page aligned, so
onnxruntime maps what it does not repack): peak memory stays near one tensor, not the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ._gguf_file import GgufTensor
from ._gguf_weights import PackedMatrix, _requantized, dequantize, pack_matrix
from ._names import GgufError

__all__ = ["ARCHITECTURES", "Architecture", "Hyperparameters", "write_graph"]


@dataclass(frozen=True, slots=True)
class Architecture:
    """How one llama.cpp architecture differs from llama."""

    og_type: str
    """onnxruntime-genai's model type for genai_config.json."""
    rope_interleaved: bool
    """llama.cpp's rope type NORM (adjacent pairs) rather than NEOX (halves)."""
    qkv_bias: bool = False
    qk_norm: bool = False
    gelu: bool = False
    """GELU (tanh form, as ggml's) gates the feed-forward rather than SiLU (Gemma)."""
    scaled_embedding: bool = False
    """Embeddings times sqrt(hidden size) (Gemma)."""


ARCHITECTURES: Mapping[str, Architecture] = {
    "llama": Architecture("llama", rope_interleaved=True),
    "qwen2": Architecture("qwen2", rope_interleaved=False, qkv_bias=True),
    "qwen3": Architecture("qwen3", rope_interleaved=False, qk_norm=True),
    "gemma": Architecture("gemma", rope_interleaved=False, gelu=True, scaled_embedding=True),
}
"""The architectures both llama.cpp's GGUF and og's engines know that this converter
writes (Mistral's and most Llama-shaped models' files say ``llama``). Others are refused,
naming the architecture: Phi-3's fused matrices, Gemma 2/3's softcaps and sliding
windows, Granite's multipliers are each a short addition here, not yet made (each needs
a tiny file llama.cpp itself loads, to check against: tests/fixtures/gguf)."""

_MAX_DIMENSION = 1 << 20
"""Larger hidden sizes, heads or vocabularies are a lying header, not a model."""
_MAX_CONTEXT = 1 << 20


@dataclass(frozen=True, slots=True)
class Hyperparameters:
    """The numbers a decoder's graph is made of, from the file's ``<arch>.*`` keys."""

    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    rotary_dim: int
    feed_forward: int
    context_length: int
    epsilon: float
    rope_base: float
    vocab_size: int
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, fields: Mapping[str, Any], tensors: Mapping[str, GgufTensor]) -> Hyperparameters:
        arch = str(fields.get("general.architecture", ""))
        if arch not in ARCHITECTURES:
            raise GgufError(
                f"architecture {arch or '(none)'!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            )

        def number(key: str, default: Any = None) -> Any:
            value = fields.get(f"{arch}.{key}", default)
            if value is None:
                raise GgufError(f"the file lacks {arch}.{key}")
            return value

        hidden = int(number("embedding_length"))
        heads = int(number("attention.head_count"))
        kv_heads = int(number("attention.head_count_kv", heads))
        head_size = int(number("attention.key_length", hidden // max(heads, 1)))
        embedding = tensors.get("token_embd.weight")
        if embedding is None:
            raise GgufError("the file has no token_embd.weight")
        vocab = int(embedding.shape[1]) if len(embedding.shape) == 2 else 0
        params = cls(
            architecture=arch,
            layers=int(number("block_count")),
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_size=head_size,
            rotary_dim=int(number("rope.dimension_count", head_size)),
            feed_forward=int(number("feed_forward_length")),
            context_length=int(number("context_length")),
            epsilon=float(number("attention.layer_norm_rms_epsilon")),
            rope_base=float(number("rope.freq_base", 10000.0)),
            vocab_size=vocab,
            rope_scaling=str(fields.get(f"{arch}.rope.scaling.type", "none")),
            rope_factor=float(fields.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0),
        )
        params.check()
        return params

    def check(self) -> None:
        """Refuse numbers no real model has before anything is allocated from them."""
        for name in ("layers", "hidden", "heads", "kv_heads", "head_size", "feed_forward", "vocab_size"):
            value = getattr(self, name)
            if not 0 < value <= _MAX_DIMENSION:
                raise GgufError(f"{name} = {value} is out of range (1 to {_MAX_DIMENSION})")
        if not 0 < self.context_length <= _MAX_CONTEXT:
            raise GgufError(f"context_length = {self.context_length} is out of range (1 to {_MAX_CONTEXT})")
        if self.heads % self.kv_heads:
            raise GgufError(f"{self.heads} attention heads do not divide into {self.kv_heads} key/value heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_size:
            raise GgufError(f"rope.dimension_count = {self.rotary_dim} does not fit head size {self.head_size}")
        if self.rope_scaling not in ("none", "linear"):
            raise GgufError(f"rope scaling {self.rope_scaling!r} is not supported (none, linear)")
        if not (self.epsilon > 0 and math.isfinite(self.rope_base) and self.rope_base > 1):
            raise GgufError("the norm epsilon or rope frequency base is not a positive number")


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


def _rotary_caches(params: Hyperparameters, rope_factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches (positions x rotary_dim/2) as llama.cpp computes its rotation angles."""
    half = params.rotary_dim // 2
    inv_freq = 1.0 / (params.rope_base ** (np.arange(0, half, dtype=np.float64) * 2 / params.rotary_dim))
    if rope_factors is not None:
        inv_freq = inv_freq / rope_factors.astype(np.float64)[:half]
    positions = np.arange(params.context_length, dtype=np.float64)
    if params.rope_scaling == "linear":
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
    total = sum(int(t.n_bytes) for t in tensors.values()) or 1
    done = 0

    def tensor(name: str) -> GgufTensor:
        found = tensors.get(name)
        if found is None:
            raise GgufError(f"the file lacks the tensor {name}")
        return found

    def matrix(name: str, out_features: int, in_features: int) -> PackedMatrix:
        nonlocal done
        t = tensor(name)
        _check_shape(t, (in_features, out_features))
        packed = pack_matrix(t.data, t.tensor_type, out_features, in_features)
        done += int(t.n_bytes)
        progress(done / total)
        return packed

    def vector(name: str, size: int) -> np.ndarray:
        t = tensor(name)
        _check_shape(t, (size,))
        return dequantize(t.data, t.tensor_type, (size,))

    # attention_mask -> what GroupQueryAttention takes: each row's last position and the width.
    one = graph.constant("/constants/one", np.array([1], np.int64))
    (mask_sum,) = graph.node("ReduceSum", ["attention_mask", one], "/mask/sum", keepdims=0)
    (last,) = graph.node("Sub", [mask_sum, one], "/mask/last")
    (seqlens_k,) = graph.node("Cast", [last], "/mask/seqlens_k", to=TensorProto.INT32)
    (shape,) = graph.node("Shape", ["attention_mask"], "/mask/shape")
    (width,) = graph.node("Gather", [shape, one], "/mask/width", axis=0)
    (total_length,) = graph.node("Cast", [width], "/mask/total", to=TensorProto.INT32)
    factors = tensors.get("rope_freqs.weight")
    cos, sin = _rotary_caches(params, dequantize(factors.data, factors.tensor_type, (-1,)) if factors else None)
    cos_cache, sin_cache = graph.constant("cos_cache", cos), graph.constant("sin_cache", sin)

    embedding = tensor("token_embd.weight")
    _check_shape(embedding, (params.hidden, params.vocab_size))
    hidden = graph.embedding(
        pack_matrix(embedding.data, embedding.tensor_type, params.vocab_size, params.hidden), "input_ids"
    )
    if arch.scaled_embedding:
        scale = graph.constant("/embed/scale", np.array(math.sqrt(params.hidden), np.float32))
        (hidden,) = graph.node("Mul", [hidden, scale], "/embed/scaled")
    residual = hidden
    q_size, kv_size = params.heads * params.head_size, params.kv_heads * params.head_size
    normed = ""
    for i in range(params.layers):
        prefix = f"blk.{i}"
        norm = graph.constant(f"{prefix}.attn_norm.weight", vector(f"{prefix}.attn_norm.weight", params.hidden))
        if i == 0:
            (normed,) = graph.node(
                "SimplifiedLayerNormalization",
                [hidden, norm],
                f"/{prefix}/attn_norm",
                epsilon=params.epsilon,
                axis=-1,
                stash_type=1,
            )
        else:
            normed, _, _, residual = graph.node(
                "SkipSimplifiedLayerNormalization",
                [residual, hidden, norm],
                f"/{prefix}/attn_norm",
                outputs=4,
                domain="com.microsoft",
                epsilon=params.epsilon,
            )
        q = matrix(f"{prefix}.attn_q.weight", q_size, params.hidden)
        k = matrix(f"{prefix}.attn_k.weight", kv_size, params.hidden)
        v = matrix(f"{prefix}.attn_v.weight", kv_size, params.hidden)
        fused = None if arch.qkv_bias or arch.qk_norm else _fused([q, k, v])
        if fused is not None:
            query, key, value = graph.linear(normed, fused, f"/{prefix}/attn_qkv"), "", ""
        else:
            query = graph.linear(normed, q, f"/{prefix}/attn_q")
            key = graph.linear(normed, k, f"/{prefix}/attn_k")
            value = graph.linear(normed, v, f"/{prefix}/attn_v")
            if arch.qkv_bias:
                query, key, value = (
                    graph.node(
                        "Add",
                        [x, graph.constant(f"{prefix}.attn_{n}.bias", vector(f"{prefix}.attn_{n}.bias", s))],
                        f"/{prefix}/attn_{n}/bias",
                    )[0]
                    for x, n, s in ((query, "q", q_size), (key, "k", kv_size), (value, "v", kv_size))
                )
            if arch.qk_norm:
                query = _head_norm(
                    graph,
                    query,
                    vector(f"{prefix}.attn_q_norm.weight", params.head_size),
                    f"/{prefix}/attn_q_norm",
                    params,
                )
                key = _head_norm(
                    graph,
                    key,
                    vector(f"{prefix}.attn_k_norm.weight", params.head_size),
                    f"/{prefix}/attn_k_norm",
                    params,
                )
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
            scale=1.0 / math.sqrt(params.head_size),
            do_rotary=1,
            rotary_interleaved=int(arch.rope_interleaved),
        )
        graph.nodes[-1].output[1:] = [f"present.{i}.key", f"present.{i}.value"]
        hidden = graph.linear(
            attention, matrix(f"{prefix}.attn_output.weight", params.hidden, q_size), f"/{prefix}/attn_output"
        )
        ffn_norm = graph.constant(f"{prefix}.ffn_norm.weight", vector(f"{prefix}.ffn_norm.weight", params.hidden))
        normed, _, _, residual = graph.node(
            "SkipSimplifiedLayerNormalization",
            [residual, hidden, ffn_norm],
            f"/{prefix}/ffn_norm",
            outputs=4,
            domain="com.microsoft",
            epsilon=params.epsilon,
        )
        product = _gated(graph, arch, params, normed, prefix, matrix)
        hidden = graph.linear(
            product, matrix(f"{prefix}.ffn_down.weight", params.hidden, params.feed_forward), f"/{prefix}/ffn_down"
        )
    output_norm = graph.constant("output_norm.weight", vector("output_norm.weight", params.hidden))
    (normed,) = graph.node(
        "SkipSimplifiedLayerNormalization",
        [residual, hidden, output_norm],
        "/output_norm",
        domain="com.microsoft",
        epsilon=params.epsilon,
    )
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied embeddings
    head = matrix(head_name, params.vocab_size, params.hidden)
    if head.offsets is not None:
        # One node writes the logits (the ort-cpu engine gathers the last position in front
        # of it): a type with minimums is requantized to 8 bits here.
        t = tensor(head_name)
        head = _requantized(dequantize(t.data, t.tensor_type, (params.vocab_size, params.hidden)))
    graph.linear(normed, head, "/lm_head", output="logits")


def _gated(
    graph: _Graph,
    arch: Architecture,
    params: Hyperparameters,
    normed: str,
    prefix: str,
    matrix: Callable[[str, int, int], PackedMatrix],
) -> str:
    """The feed-forward's gated product, ``act(gate) * up``, before its down projection."""
    gate = graph.linear(
        normed, matrix(f"{prefix}.ffn_gate.weight", params.feed_forward, params.hidden), f"/{prefix}/ffn_gate"
    )
    up = graph.linear(
        normed, matrix(f"{prefix}.ffn_up.weight", params.feed_forward, params.hidden), f"/{prefix}/ffn_up"
    )
    if arch.gelu:
        (activated,) = graph.node("Gelu", [gate], f"/{prefix}/ffn_gelu", approximate="tanh")
    else:
        (sigmoid,) = graph.node("Sigmoid", [gate], f"/{prefix}/ffn_sigmoid")
        (activated,) = graph.node("Mul", [gate, sigmoid], f"/{prefix}/ffn_silu")
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


def _check_shape(tensor: GgufTensor, expected: tuple[int, ...]) -> None:
    """A tensor's dimensions (ggml order: fastest first) as the hyperparameters say."""
    shape = tuple(int(d) for d in tensor.shape)
    if shape != expected:
        raise GgufError(f"tensor {tensor.name} has shape {list(shape)}, the header implies {list(expected)}")
