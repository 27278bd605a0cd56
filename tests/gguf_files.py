"""Tiny GGUF files written with gguf-py's own writer, and llama.cpp's arithmetic on them.

``write_tiny_gguf`` makes a small decoder (random weights, seeded) of a llama.cpp
architecture with a byte-level BPE vocabulary, its matrices in a chosen block type
(quantized by gguf-py where it can, else random blocks with sane scales: the K-quants).
``reference_logits`` runs the decoder the way llama.cpp defines it, in float64 NumPy over
gguf-py's dequantized weights: the independent reference the converter is held to.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import onnxruntime as ort
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


SLIDING_WINDOW = 8
"""The tiny files' sliding window: shorter than the test prompts, so local layers drop keys."""
_LAYERS = {"gemma3": 6}  # Gemma 3's first global layer is its sixth
_HEAD = {"gemma3": 32}  # a head size other than hidden / heads (queries of 128, not 256)
_POST_NORMS = ("gemma2", "gemma3", "olmo2")
_LAYER_NORMS = ("olmo", "nemotron")
"""LayerNorm rather than RMS norms: OLMo 1's without weights, Nemotron's with weight and bias."""
OLMO_CLAMP_KQV = 1.5
"""Below the tiny file's projections' largest values, so the clamp changes queries, keys and values."""
NEMOTRON_ROTARY = HEAD // 2
"""Nemotron rotates half of each head (its partial_rotary_factor 0.5)."""
_SEEDS = {"nemotron": 3}
"""Seeds other than 0: seed 0's Nemotron file has a tie in llama.cpp's own greedy choice
(two tokens 0.001 apart at the third step), which no comparison can hold to."""
GRANITE_SCALES = {"embedding": 6.0, "residual": 0.5, "attention": 0.1, "logit": 2.0}
GEMMA2_SOFTCAPS = {"attention": 2.0, "final": 4.0}
"""Far below Gemma 2's own (50, 30), where tanh bends random weights' scores and logits."""


# Types with minimums are tied only to a head of their own in the tests (a tied one is requantized).
WITH_MINIMUMS = (Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K)
PROMPT = [256 + 2, 104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10, 257, 258, 32, 116, 104, 101]


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    qtype: Q = Q.Q4_0,
    seed: int | None = None,
    tied: bool = True,
    sentencepiece_pieces: list[str] | None = None,
    unembedded: list[tuple[str, int]] | None = None,
) -> Path:
    """A tiny decoder of ``arch`` (llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3, granite,
    olmo, olmo2, nemotron) whose matrices are ``qtype``, each with what its architecture adds:
    Gemma 2's softcaps, post-norms and sliding window on alternate layers, Gemma 3's per-head
    norms and local/global rope, Phi-3's fused matrices, Granite's multipliers, OLMo 1's
    weightless LayerNorms and query/key/value clamp, OLMo 2's post-norms, Nemotron's
    LayerNorms with biases, squared-ReLU feed-forward, partial rotary embeddings and biases
    on every projection. ``sentencepiece_pieces``: a SentencePiece vocabulary instead
    (``tokenizer.ggml.model`` "llama", scores 0) of the byte-level one plus these pieces.
    ``unembedded``: (text, type) tokens added past the embedding's rows."""
    rng = np.random.default_rng(_SEEDS.get(arch, 0) if seed is None else seed)
    tokens, types = _vocabulary()
    if sentencepiece_pieces is not None:
        tokens, types = tokens + sentencepiece_pieces, types + [1] * len(sentencepiece_pieces)
    if arch == "phi3":  # llama.cpp's Phi-3 vocabulary loader looks these up by text (unordered_map::at)
        tokens, types = [*tokens, "<unk>", "<s>", "</s>"], [*types, 2, 3, 3]
    vocab = len(tokens)
    if unembedded:  # (text, type) tokens past the embedding's rows: a hostile file
        tokens, types = tokens + [t for t, _ in unembedded], types + [k for _, k in unembedded]
    layers, head = _LAYERS.get(arch, LAYERS), _HEAD.get(arch, HEAD)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}-{qtype.name}")
    writer.add_block_count(layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(NEMOTRON_ROTARY if arch == "nemotron" else head)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    if arch in _LAYER_NORMS:
        writer.add_layer_norm_eps(1e-5)
    else:
        writer.add_layer_norm_rms_eps(1e-5)
    if sentencepiece_pieces is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(MERGES)
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    _architecture_keys(writer, arch)

    def vector(size: int, around: float = 1.0) -> np.ndarray:
        return (around + 0.1 * rng.standard_normal(size)).astype(np.float32)

    def matrix(name: str, out_features: int, in_features: int) -> None:
        _add(writer, name, random_matrix(rng, out_features, in_features, qtype), qtype)

    embedding_type = Q.F32 if qtype in (Q.F32, Q.F16) else qtype  # tied: the head too
    _add(writer, "token_embd.weight", random_matrix(rng, vocab, HIDDEN, embedding_type), embedding_type)
    if arch.startswith("gemma"):
        writer.add_key_length(head)
        writer.add_value_length(head)
    for i in range(layers):
        _write_layer(writer, arch, f"blk.{i}", head, vector, matrix)
    _add_norm(writer, arch, "output_norm", vector)
    if not tied:
        _add(writer, "output.weight", random_matrix(rng, vocab, HIDDEN, Q.Q6_K), Q.Q6_K)
    elif arch in ("olmo2", "nemotron"):  # llama.cpp requires their own head
        _add(writer, "output.weight", random_matrix(rng, vocab, HIDDEN, embedding_type), embedding_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _architecture_keys(writer: gguf.GGUFWriter, arch: str) -> None:
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(GEMMA2_SOFTCAPS["attention"])
        writer.add_final_logit_softcapping(GEMMA2_SOFTCAPS["final"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(SLIDING_WINDOW)
    if arch == "gemma3":  # global layers: their own base, scaled 8x; local ones: 10000, unscaled
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)
    if arch == "olmo":
        writer.add_clamp_kqv(OLMO_CLAMP_KQV)
    if arch == "granite":
        writer.add_embedding_scale(GRANITE_SCALES["embedding"])
        writer.add_residual_scale(GRANITE_SCALES["residual"])
        writer.add_attention_scale(GRANITE_SCALES["attention"])
        writer.add_logit_scale(GRANITE_SCALES["logit"])


def _write_layer(
    writer: gguf.GGUFWriter,
    arch: str,
    p: str,
    head: int,
    vector: Callable[..., np.ndarray],
    matrix: Callable[[str, int, int], None],
) -> None:
    q_size, kv_size = HEADS * head, KV_HEADS * head
    biases = arch == "nemotron"  # optional in llama.cpp: the tiny file has every one
    if arch != "olmo2":  # OLMo 2 norms after attention and feed-forward only
        _add_norm(writer, arch, f"{p}.attn_norm", vector)
    if arch == "phi3":  # query, key and value rows in one matrix
        matrix(f"{p}.attn_qkv.weight", q_size + 2 * kv_size, HIDDEN)
    else:
        for name, out_features in (("attn_q", q_size), ("attn_k", kv_size), ("attn_v", kv_size)):
            matrix(f"{p}.{name}.weight", out_features, HIDDEN)
            if arch == "qwen2" or biases:
                writer.add_tensor(f"{p}.{name}.bias", vector(out_features, 0.0))
    if arch in ("qwen3", "gemma3"):
        writer.add_tensor(f"{p}.attn_q_norm.weight", vector(head))
        writer.add_tensor(f"{p}.attn_k_norm.weight", vector(head))
    if arch == "olmo2":  # over the whole projection, not per head
        writer.add_tensor(f"{p}.attn_q_norm.weight", vector(q_size))
        writer.add_tensor(f"{p}.attn_k_norm.weight", vector(kv_size))
    matrix(f"{p}.attn_output.weight", HIDDEN, q_size)
    if biases:
        writer.add_tensor(f"{p}.attn_output.bias", vector(HIDDEN, 0.0))
    if arch in _POST_NORMS:
        writer.add_tensor(f"{p}.post_attention_norm.weight", vector(HIDDEN))
    if arch != "olmo2":
        _add_norm(writer, arch, f"{p}.ffn_norm", vector)
    if arch == "phi3":  # gate rows, then up rows
        matrix(f"{p}.ffn_up.weight", 2 * FFN, HIDDEN)
    else:
        if arch != "nemotron":  # Nemotron's feed-forward has no gate
            matrix(f"{p}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"{p}.ffn_up.weight", FFN, HIDDEN)
    if biases:
        writer.add_tensor(f"{p}.ffn_up.bias", vector(FFN, 0.0))
    matrix(f"{p}.ffn_down.weight", HIDDEN, FFN)
    if biases:
        writer.add_tensor(f"{p}.ffn_down.bias", vector(HIDDEN, 0.0))
    if arch in _POST_NORMS:
        writer.add_tensor(f"{p}.post_ffw_norm.weight", vector(HIDDEN))


def _add_norm(writer: gguf.GGUFWriter, arch: str, name: str, vector: Callable[..., np.ndarray]) -> None:
    """A block norm's parameters: none for OLMo 1, a weight (and a bias for Nemotron)."""
    if arch == "olmo":
        return
    writer.add_tensor(f"{name}.weight", vector(HIDDEN))
    if arch == "nemotron":
        writer.add_tensor(f"{name}.bias", vector(HIDDEN, 0.0))


def _add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
    writer.add_tensor(name, data, raw_dtype=raw_dtype)


def run_folder(folder: Path, ids: list[int], provider: str = "CPUExecutionProvider") -> np.ndarray:
    """Every position's logits of the converted folder's graph, onnxruntime directly on
    ``provider`` (an execution provider's name)."""
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=[provider])
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
    }
    shape = (1, decoder["num_key_value_heads"], len(ids), decoder["head_size"])
    for i in range(decoder["num_hidden_layers"]):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros(shape, np.float32)
    return session.run(["logits"], feeds)[0][0]


def reference_logits(path: Path, ids: list[int]) -> np.ndarray:
    """Every position's logits for ``ids`` as llama.cpp defines the decoder of ``path``
    (float64, from gguf-py's reader and dequantizer; the numbers from the file's keys with
    llama.cpp's defaults: ``src/models/<arch>.cpp``, ``src/llama-model.cpp``)."""
    model = _Reference(gguf.GGUFReader(str(path)), len(ids))
    x = model.weight("token_embd.weight")[ids] * model.embedding_scale
    for i in range(model.layers):
        x = model.layer(x, i)
    head = "output.weight" if "output.weight" in model.tensors else "token_embd.weight"
    logits = model.norm(x, "output_norm") @ model.weight(head).T / model.logit_scale
    if model.final_softcap:
        logits = model.final_softcap * np.tanh(logits / model.final_softcap)
    return logits


class _Reference:
    """One file's decoder in float64: its numbers, and a layer's arithmetic."""

    def __init__(self, reader: gguf.GGUFReader, count: int) -> None:
        self.reader, self.count = reader, count
        self.arch = arch = str(reader.fields["general.architecture"].contents())
        self.tensors = {t.name: t for t in reader.tensors}
        hidden, self.heads = int(self.key("embedding_length")), int(self.key("attention.head_count"))
        self.kv_heads, self.layers = int(self.key("attention.head_count_kv")), int(self.key("block_count"))
        self.head = int(self.key("attention.key_length", hidden // self.heads))
        self.rotary = int(self.key("rope.dimension_count", self.head))
        self.layer_norms = arch in ("olmo", "nemotron")  # LayerNorm, not RMS
        self.eps = self.key("attention.layer_norm_epsilon" if self.layer_norms else "attention.layer_norm_rms_epsilon")
        self.clamp = self.key("attention.clamp_kqv", 0.0) if arch == "olmo" else 0.0
        self.gemma = arch in ("gemma", "gemma2", "gemma3")
        # Sliding windows: llama.cpp's layer patterns (local unless the last of each period);
        # it ignores Phi-3's window. Local layers of Gemma 3 rotate with base 10000, unscaled.
        self.window = int(self.key("attention.sliding_window", 4096 if arch == "gemma2" else 0))
        period = {"gemma2": 2, "gemma3": 6}.get(arch, 0)
        self.local = [bool(self.window and period and i % period < period - 1) for i in range(self.layers)]
        scaling = reader.fields.get(f"{arch}.rope.scaling.type")
        factor = self.key("rope.scaling.factor", 1.0) if scaling and scaling.contents() == "linear" else 1.0
        rotation = self._rotation(self.key("rope.freq_base", 10000.0), factor)
        self.rotations = {False: rotation, True: self._rotation(10000.0, 1.0) if arch == "gemma3" else rotation}
        self.scale = 1 / np.sqrt(self.head)
        if arch == "granite":
            self.scale = self.key("attention.scale", self.scale)
        if (arch, self.layers) in (("gemma2", 46), ("gemma3", 62)):  # the 27B models: hidden / heads
            self.scale = 1 / np.sqrt(hidden // self.heads)
        self.softcap = self.key("attn_logit_softcapping", 50.0) if arch == "gemma2" else 0.0
        self.final_softcap = self.key("final_logit_softcapping", 30.0) if arch == "gemma2" else 0.0
        granite = arch == "granite"
        self.residual_scale = self.key("residual_scale", 1.0) if granite else 1.0
        self.embedding_scale = np.sqrt(hidden) if self.gemma else self.key("embedding_scale", 1.0) if granite else 1.0
        self.logit_scale = self.key("logit_scale", 1.0) if granite else 1.0

    def key(self, name: str, default: float | None = None) -> float:
        field = self.reader.fields.get(f"{self.arch}.{name}")
        value = field.contents() if field is not None else default
        assert value is not None, name
        return float(value)

    def weight(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """The block norm ``name``: RMS by its weight, or LayerNorm (ggml_norm) times the
        weight plus the bias where the file has them (none: OLMo 1)."""
        if not self.layer_norms:
            return self.rms(x, self.weight(f"{name}.weight"))
        centred = x - x.mean(-1, keepdims=True)
        out = centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + self.eps)
        if f"{name}.weight" in self.tensors:
            out = out * self.weight(f"{name}.weight")
        return out + self.bias(name)

    def bias(self, name: str) -> np.ndarray | float:
        return self.weight(f"{name}.bias") if f"{name}.bias" in self.tensors else 0.0

    def _rotation(self, base: float, factor: float) -> tuple[np.ndarray, np.ndarray]:
        angles = np.outer(np.arange(self.count) / factor, 1.0 / base ** (np.arange(0, self.rotary, 2) / self.rotary))
        return np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(self, x: np.ndarray, local: bool) -> np.ndarray:
        cos, sin = self.rotations[local]
        out, half = x.copy(), self.rotary // 2  # past rope.dimension_count: not rotated (Nemotron)
        x = x[..., : self.rotary]
        if self.arch in ("llama", "granite", "olmo"):  # NORM: adjacent pairs
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0 : self.rotary : 2], out[..., 1 : self.rotary : 2] = a * cos - b * sin, a * sin + b * cos
        else:  # NEOX: halves
            a, b = x[..., :half], x[..., half:]
            out[..., :half], out[..., half : self.rotary] = a * cos - b * sin, a * sin + b * cos
        return out

    def layer(self, x: np.ndarray, i: int) -> np.ndarray:
        p, olmo2 = f"blk.{i}", self.arch == "olmo2"  # OLMo 2: no norm in front of the blocks
        out = self.attention(x if olmo2 else self.norm(x, f"{p}.attn_norm"), i)
        if f"{p}.post_attention_norm.weight" in self.tensors:
            out = self.rms(out, self.weight(f"{p}.post_attention_norm.weight"))
        x = x + out * self.residual_scale
        out = self.feed_forward(x if olmo2 else self.norm(x, f"{p}.ffn_norm"), p)
        if f"{p}.post_ffw_norm.weight" in self.tensors:
            out = self.rms(out, self.weight(f"{p}.post_ffw_norm.weight"))
        return x + out * self.residual_scale

    def attention(self, h: np.ndarray, i: int) -> np.ndarray:
        p, count, head, heads, kv_heads = f"blk.{i}", self.count, self.head, self.heads, self.kv_heads
        if f"{p}.attn_qkv.weight" in self.tensors:
            q, k, v = np.split(h @ self.weight(f"{p}.attn_qkv.weight").T, [heads * head, (heads + kv_heads) * head], -1)
        else:
            q, k, v = (h @ self.weight(f"{p}.attn_{n}.weight").T for n in "qkv")
        q, k, v = (y + self.bias(f"{p}.attn_{n}") for y, n in zip((q, k, v), "qkv", strict=True))
        if self.clamp:  # OLMo 1
            q, k, v = (np.clip(y, -self.clamp, self.clamp) for y in (q, k, v))
        if self.arch == "olmo2":  # over the whole projection
            q, k = (
                self.rms(q, self.weight(f"{p}.attn_q_norm.weight")),
                self.rms(k, self.weight(f"{p}.attn_k_norm.weight")),
            )
        q, k, v = q.reshape(count, heads, head), k.reshape(count, kv_heads, head), v.reshape(count, kv_heads, head)
        if self.arch in ("qwen3", "gemma3"):  # per head
            q, k = (
                self.rms(q, self.weight(f"{p}.attn_q_norm.weight")),
                self.rms(k, self.weight(f"{p}.attn_k_norm.weight")),
            )
        q, k = self.rope(q, self.local[i]), self.rope(k, self.local[i])
        k, v = np.repeat(k, heads // kv_heads, 1), np.repeat(v, heads // kv_heads, 1)
        scores = np.einsum("shd,thd->hst", q, k) * self.scale
        if self.softcap:
            scores = self.softcap * np.tanh(scores / self.softcap)
        distance = np.arange(count)[:, None] - np.arange(count)[None, :]
        masked = (distance < 0) | ((distance >= self.window) if self.local[i] else False)
        scores = scores + np.where(masked, -np.inf, 0.0)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        mixed = np.einsum("hst,thd->shd", probs, v).reshape(count, heads * head)
        return mixed @ self.weight(f"{p}.attn_output.weight").T + self.bias(f"{p}.attn_output")

    def feed_forward(self, h: np.ndarray, p: str) -> np.ndarray:
        down = self.weight(f"{p}.ffn_down.weight").T
        if self.arch == "nemotron":  # squared ReLU of up, no gate
            up = h @ self.weight(f"{p}.ffn_up.weight").T + self.bias(f"{p}.ffn_up")
            return np.maximum(up, 0.0) ** 2 @ down + self.bias(f"{p}.ffn_down")
        if f"{p}.ffn_gate.weight" in self.tensors:
            gate, up = h @ self.weight(f"{p}.ffn_gate.weight").T, h @ self.weight(f"{p}.ffn_up.weight").T
        else:  # Phi-3: gate and up in one matrix
            gate, up = np.split(h @ self.weight(f"{p}.ffn_up.weight").T, 2, -1)
        if self.gemma:  # GELU, tanh form
            activated = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        else:
            activated = gate / (1 + np.exp(-gate))
        return (activated * up) @ down
