"""Tiny GGUF files written with gguf-py's own writer, and llama.cpp's arithmetic on them.

``write_tiny_gguf`` makes a small decoder (random weights, seeded) of a llama.cpp
architecture with a byte-level BPE vocabulary, its matrices in a chosen block type
(quantized by gguf-py where it can, else random blocks with sane scales: the K-quants).
``reference_logits`` runs the decoder the way llama.cpp defines it, in float64 NumPy over
gguf-py's dequantized weights: the independent reference the converter is held to.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

__all__ = ["BYTE_TOKENS", "random_matrix", "reference_logits", "write_tiny_gguf"]

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, CONTEXT = 256, 4, 2, 512, 2, 256
HEAD = HIDDEN // HEADS


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map of byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


BYTE_TOKENS = [_bytes_to_unicode()[b] for b in range(256)]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _vocabulary() -> tuple[list[str], list[int]]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = BYTE_TOKENS + merged + SPECIAL
    types = [1] * (len(BYTE_TOKENS) + len(merged)) + [3] * len(SPECIAL)
    return tokens, types


def random_matrix(rng: np.random.Generator, out_features: int, in_features: int, qtype: Q) -> np.ndarray:
    """A matrix's bytes in ``qtype`` as a GGUF file holds them."""
    weights = (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)
    if qtype == Q.F32:
        return weights
    if qtype == Q.F16:
        return weights.astype(np.float16)
    try:
        return quants.quantize(weights, qtype)
    except (NotImplementedError, quants.QuantError):  # gguf-py writes no K-quants: random blocks with sane scales
        block, size = quants.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (out_features * in_features // block, size), dtype=np.uint8)
        scale_at = {Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,), Q.IQ4_NL: (0,)}[
            qtype
        ]
        for at in scale_at:
            scales = rng.uniform(0.0005, 0.004, len(raw)).astype(np.float16)
            raw[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
        return raw.reshape(out_features, -1)


def write_tiny_gguf(path: Path, *, arch: str = "llama", qtype: Q = Q.Q4_0, seed: int = 0, tied: bool = True) -> Path:
    """A tiny decoder of ``arch`` (llama, qwen2, qwen3, gemma) whose matrices are ``qtype``."""
    rng = np.random.default_rng(seed)
    tokens, types = _vocabulary()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}-{qtype.name}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def vector(size: int, around: float = 1.0) -> np.ndarray:
        return (around + 0.1 * rng.standard_normal(size)).astype(np.float32)

    embedding_type = Q.F32 if qtype in (Q.F32, Q.F16) else qtype  # tied: the head too
    _add(writer, "token_embd.weight", random_matrix(rng, vocab, HIDDEN, embedding_type), embedding_type)
    if arch == "gemma":
        writer.add_key_length(HEAD)
        writer.add_value_length(HEAD)
    for i in range(LAYERS):
        p = f"blk.{i}"
        writer.add_tensor(f"{p}.attn_norm.weight", vector(HIDDEN))
        for name, out_features in (("attn_q", HIDDEN), ("attn_k", KV_HEADS * HEAD), ("attn_v", KV_HEADS * HEAD)):
            _add(writer, f"{p}.{name}.weight", random_matrix(rng, out_features, HIDDEN, qtype), qtype)
            if arch == "qwen2":
                writer.add_tensor(f"{p}.{name}.bias", vector(out_features, 0.0))
        if arch == "qwen3":
            writer.add_tensor(f"{p}.attn_q_norm.weight", vector(HEAD))
            writer.add_tensor(f"{p}.attn_k_norm.weight", vector(HEAD))
        _add(writer, f"{p}.attn_output.weight", random_matrix(rng, HIDDEN, HIDDEN, qtype), qtype)
        writer.add_tensor(f"{p}.ffn_norm.weight", vector(HIDDEN))
        _add(writer, f"{p}.ffn_gate.weight", random_matrix(rng, FFN, HIDDEN, qtype), qtype)
        _add(writer, f"{p}.ffn_up.weight", random_matrix(rng, FFN, HIDDEN, qtype), qtype)
        _add(writer, f"{p}.ffn_down.weight", random_matrix(rng, HIDDEN, FFN, qtype), qtype)
    writer.add_tensor("output_norm.weight", vector(HIDDEN))
    if not tied:
        _add(writer, "output.weight", random_matrix(rng, vocab, HIDDEN, Q.Q6_K), Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
    writer.add_tensor(name, data, raw_dtype=raw_dtype)


def reference_logits(path: Path, ids: list[int]) -> np.ndarray:
    """Every position's logits for ``ids`` as llama.cpp defines the decoder of ``path``
    (float64, from gguf-py's reader and dequantizer)."""
    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    tensors = {t.name: t for t in reader.tensors}

    def weight(name: str) -> np.ndarray:
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)

    count = len(ids)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, HEAD, 2) / HEAD)
    angles = np.outer(np.arange(count), inv_freq)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    def rope(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        if arch == "llama":  # NORM: adjacent pairs
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        else:  # NEOX: halves
            a, b = x[..., : HEAD // 2], x[..., HEAD // 2 :]
            out[..., : HEAD // 2], out[..., HEAD // 2 :] = a * cos - b * sin, a * sin + b * cos
        return out

    x = weight("token_embd.weight")[ids]
    if arch == "gemma":
        x = x * np.sqrt(HIDDEN)
    for i in range(LAYERS):
        p = f"blk.{i}"
        h = rms(x, weight(f"{p}.attn_norm.weight"))
        qkv = []
        for name, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
            y = h @ weight(f"{p}.{name}.weight").T
            if f"{p}.{name}.bias" in tensors:
                y = y + weight(f"{p}.{name}.bias")
            qkv.append(y.reshape(count, heads, HEAD))
        q, k, v = qkv
        if arch == "qwen3":
            q, k = rms(q, weight(f"{p}.attn_q_norm.weight")), rms(k, weight(f"{p}.attn_k_norm.weight"))
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, HEADS // KV_HEADS, 1), np.repeat(v, HEADS // KV_HEADS, 1)
        scores = np.einsum("shd,thd->hst", q, k) / np.sqrt(HEAD) + np.triu(np.full((count, count), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hst,thd->shd", probs, v).reshape(count, HIDDEN) @ weight(f"{p}.attn_output.weight").T
        h = rms(x, weight(f"{p}.ffn_norm.weight"))
        gate, up = h @ weight(f"{p}.ffn_gate.weight").T, h @ weight(f"{p}.ffn_up.weight").T
        if arch == "gemma":  # GELU, tanh form
            activated = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            activated = gate / (1 + np.exp(-gate))
        x = x + (activated * up) @ weight(f"{p}.ffn_down.weight").T
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return rms(x, weight("output_norm.weight")) @ weight(head).T
