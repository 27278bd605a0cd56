"""What the converter writes differently per llama.cpp architecture, and the numbers of one
file's decoder (:class:`Hyperparameters`), read from its ``<arch>.*`` keys with llama.cpp's
defaults and checked before anything is allocated from them.

Each architecture is a short list of differences from llama (:class:`Architecture`); the
numbers behind them (softcaps, windows, multipliers, the query scale) come from the file,
and where the file is silent, from what llama.cpp assumes (``src/llama-model.cpp``), since
llama.cpp on the same file is the reference the conversion is held to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._gguf_file import GgufTensor
from ._names import GgufError

__all__ = ["ARCHITECTURES", "Architecture", "Hyperparameters"]


@dataclass(frozen=True, slots=True)
class Architecture:
    """How one llama.cpp architecture differs from llama."""

    og_type: str
    """onnxruntime-genai's model type for genai_config.json."""
    rope_interleaved: bool
    """llama.cpp's rope type NORM (adjacent pairs) rather than NEOX (halves)."""
    qkv_bias: bool = False
    qk_norm: str = ""
    """RMS norms of queries and keys: ``"head"`` each head's slice (Qwen 3, Gemma 3),
    ``"whole"`` the whole projection (OLMo 2)."""
    pre_norms: bool = True
    """A norm in front of attention and feed-forward (all but OLMo 2)."""
    post_norms: bool = False
    """A norm of attention's and feed-forward's outputs before the residual add (Gemma 2/3, OLMo 2)."""
    norm: str = "rms"
    """``"rms"``: RMS norms by the file's weights; ``"layer"``: LayerNorm by the file's
    weight and bias (Nemotron, whose layernorm1p's 1 llama.cpp's converter already added to
    the weights); ``"plain"``: LayerNorm without weight or bias (OLMo 1). The file's epsilon
    is ``attention.layer_norm_rms_epsilon`` for the first, ``attention.layer_norm_epsilon``
    for the others."""
    clamp_kqv: bool = False
    """Queries, keys and values clamped to the file's ``attention.clamp_kqv`` where it names
    one above 0 (OLMo 1)."""
    partial_rotary: bool = False
    """``rope.dimension_count`` may be below the head size: the rest of each head is not
    rotated (Nemotron)."""
    fused_gate_up: bool = False
    """``ffn_up`` holds the gate's rows, then the up projection's (Phi-3)."""
    activation: str = "silu"
    """The feed-forward's activation: ``"silu"``, ``"gelu"`` (tanh form, as ggml's: Gemma)
    or ``"relu2"`` (squared ReLU: Nemotron)."""
    gated: bool = True
    """The activation multiplies ``ffn_up``'s output (SwiGLU, GeGLU); Nemotron's feed-forward
    is ``ffn_down(act(ffn_up(x)))``, without a gate."""
    scaled_embedding: bool = False
    """Embeddings times sqrt(hidden size) (Gemma)."""
    gemma_query_scale: bool = False
    """Queries scaled by 1/sqrt(key length), by 1/sqrt(hidden / heads) on the 27B models
    (llama.cpp tells them by their layer count: ``large_model_layers``)."""
    large_model_layers: int = 0
    swa_period: int = 0
    """Sliding-window layers: all but the last of each period (llama.cpp's ``set_swa_pattern``)."""
    default_window: int = 0
    """The window where the file names none (Gemma 2's 4096, as llama.cpp assumes)."""
    local_rope_base: float = 0.0
    """The rope base of sliding-window layers, unscaled (Gemma 3's 10000); 0: as the global ones."""
    default_softcaps: tuple[float, float] = (0.0, 0.0)
    """Attention and final logit softcaps where the file names none (Gemma 2's 50 and 30)."""
    multipliers: bool = False
    """Granite's embedding, residual, attention and logit multipliers."""


ARCHITECTURES: Mapping[str, Architecture] = {
    "llama": Architecture("llama", rope_interleaved=True),
    "qwen2": Architecture("qwen2", rope_interleaved=False, qkv_bias=True),
    "qwen3": Architecture("qwen3", rope_interleaved=False, qk_norm="head"),
    "gemma": Architecture("gemma", rope_interleaved=False, activation="gelu", scaled_embedding=True),
    "gemma2": Architecture(
        "gemma2",
        rope_interleaved=False,
        post_norms=True,
        activation="gelu",
        scaled_embedding=True,
        gemma_query_scale=True,
        large_model_layers=46,
        swa_period=2,
        default_window=4096,
        default_softcaps=(50.0, 30.0),
    ),
    "gemma3": Architecture(
        "gemma3_text",
        rope_interleaved=False,
        qk_norm="head",
        post_norms=True,
        activation="gelu",
        scaled_embedding=True,
        gemma_query_scale=True,
        large_model_layers=62,
        swa_period=6,
        local_rope_base=10000.0,
    ),
    "phi3": Architecture("phi3", rope_interleaved=False, fused_gate_up=True),
    "granite": Architecture("granite", rope_interleaved=True, multipliers=True),
    "olmo": Architecture("olmo", rope_interleaved=True, norm="plain", clamp_kqv=True),
    "olmo2": Architecture("olmo", rope_interleaved=False, qk_norm="whole", pre_norms=False, post_norms=True),
    "nemotron": Architecture(
        "nemotron", rope_interleaved=False, norm="layer", partial_rotary=True, activation="relu2", gated=False
    ),
}
"""The architectures both llama.cpp's GGUF and og's engines know that this converter
writes, each held to llama-server on a tiny file (tests/fixtures/gguf): llama (Mistral's
and most Llama-shaped models' files say ``llama``), qwen2, qwen3, gemma; gemma2 (attention
and final softcaps, post-norms, a sliding window on alternate layers); gemma3 (per-head
query/key norms, five sliding-window layers in six with their own rope base, linear rope
scaling on the global ones); phi3 (fused query/key/value and gate/up matrices; LongRoPE is
refused, and its sliding window is not applied, as llama.cpp does not); granite (its four
multipliers); olmo (OLMo 1: LayerNorms without weights, queries, keys and values clamped
where the file says); olmo2 (norms after attention and feed-forward only, query/key norms
over the whole projection); nemotron (LayerNorms with weight and bias, a squared-ReLU
feed-forward without a gate, rotary embeddings over part of each head). Biases of the
projections and the feed-forward are added wherever the file has them. Any other is
refused, naming it."""

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
    clamp_kqv: float = 0.0
    """Queries, keys and values are clamped to +-this (0: not clamped)."""
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    attention_scale: float = 0.0
    """What query-key products are multiplied by (0: 1/sqrt(head size))."""
    attention_softcap: float = 0.0
    final_softcap: float = 0.0
    window: int = 0
    """Sliding-window layers attend to this many positions, their own included."""
    local_layers: tuple[bool, ...] = ()
    local_rope_base: float = 0.0
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    """Logits are divided by it (Granite)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, fields: Mapping[str, Any], tensors: Mapping[str, GgufTensor]) -> Hyperparameters:
        arch = str(fields.get("general.architecture", ""))
        if arch not in ARCHITECTURES:
            raise GgufError(
                f"architecture {arch or '(none)'!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        spec = ARCHITECTURES[arch]

        def number(key: str, default: Any = None) -> Any:
            value = fields.get(f"{arch}.{key}", default)
            if value is None:
                raise GgufError(f"the file lacks {arch}.{key}")
            if isinstance(value, list):
                raise GgufError(f"{arch}.{key} is a list of {len(value)} values: per-layer values are not supported")
            return value

        hidden = int(number("embedding_length"))
        heads = int(number("attention.head_count"))
        kv_heads = int(number("attention.head_count_kv", heads))
        head_size = int(number("attention.key_length", hidden // max(heads, 1)))
        layers = int(number("block_count"))
        embedding = tensors.get("token_embd.weight")
        if embedding is None:
            raise GgufError("the file has no token_embd.weight")
        vocab = int(embedding.shape[1]) if len(embedding.shape) == 2 else 0
        scaling = str(fields.get(f"{arch}.rope.scaling.type", "none"))
        if scaling == "longrope" or "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
            raise GgufError(
                f"{arch}: LongRoPE (rope_factors_long/short, the 128k-context Phi-3 models) is not supported; "
                "the 4k-context models are"
            )

        scale = 0.0
        if spec.gemma_query_scale:
            # llama.cpp: 1/sqrt(n_embd_head_k), but 1/sqrt(n_embd / n_head) on the 27B models.
            scale = 1 / math.sqrt(hidden // heads if layers == spec.large_model_layers else head_size)
        window, local_layers = 0, (False,) * layers
        if spec.swa_period:
            window = int(number("attention.sliding_window", spec.default_window))
            if window > 0:
                period = spec.swa_period
                local_layers = tuple(i % period < period - 1 for i in range(layers))
        attention_softcap = final_softcap = 0.0
        if any(spec.default_softcaps):
            attention_softcap = float(number("attn_logit_softcapping", spec.default_softcaps[0]))
            final_softcap = float(number("final_logit_softcapping", spec.default_softcaps[1]))
        elif arch == "gemma3" and window <= 0:  # llama.cpp: a final softcap on Gemma 3 without local layers
            final_softcap = float(number("final_logit_softcapping", 0.0))
        if arch == "olmo2" and int(fields.get(f"{arch}.attention.sliding_window", 0) or 0) > 0:
            raise GgufError("olmo2: sliding-window attention (OLMo 3) is not supported")
        # phi3: llama.cpp ignores attention.sliding_window ("Phi SWA is currently disabled"); so does this.

        epsilon_key = "attention.layer_norm_rms_epsilon" if spec.norm == "rms" else "attention.layer_norm_epsilon"
        embedding_scale = math.sqrt(hidden) if spec.scaled_embedding else 1.0
        residual_scale = logit_scale = 1.0
        if spec.multipliers:
            if fields.get(f"{arch}.rope.scaling.finetuned", True) is False:
                raise GgufError("granite without rotary embeddings (rope.scaling.finetuned false) is not supported")
            embedding_scale = float(number("embedding_scale", 0.0)) or 1.0
            residual_scale = float(number("residual_scale", 0.0)) or 1.0
            scale = float(number("attention.scale", 0.0))
            logit_scale = float(number("logit_scale"))
        params = cls(
            architecture=arch,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_size=head_size,
            rotary_dim=int(number("rope.dimension_count", head_size)),
            feed_forward=int(number("feed_forward_length")),
            context_length=int(number("context_length")),
            epsilon=float(number(epsilon_key)),
            rope_base=float(number("rope.freq_base", 10000.0)),
            vocab_size=vocab,
            clamp_kqv=float(number("attention.clamp_kqv", 0.0)) if spec.clamp_kqv else 0.0,
            rope_scaling=scaling,
            rope_factor=float(fields.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0),
            attention_scale=scale or (1 / math.sqrt(head_size) if head_size > 0 else 1.0),
            attention_softcap=attention_softcap,
            final_softcap=final_softcap,
            window=window,
            local_layers=local_layers,
            local_rope_base=float(number("rope.freq_base_swa", spec.local_rope_base)) if spec.local_rope_base else 0.0,
            embedding_scale=embedding_scale,
            residual_scale=residual_scale,
            logit_scale=logit_scale,
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
        self._check_rotary()
        if self.rope_scaling not in ("none", "linear"):
            raise GgufError(f"rope scaling {self.rope_scaling!r} is not supported (none, linear)")
        if not (self.epsilon > 0 and math.isfinite(self.rope_base) and self.rope_base > 1):
            raise GgufError("the norm epsilon or rope frequency base is not a positive number")
        if self.local_rope_base and not (math.isfinite(self.local_rope_base) and self.local_rope_base > 1):
            raise GgufError(f"the sliding-window layers' rope base {self.local_rope_base} is not a number above 1")
        if not 0 <= self.window <= _MAX_CONTEXT:
            raise GgufError(f"sliding window {self.window} is out of range (0 to {_MAX_CONTEXT})")
        numbers = {
            "attention scale": self.attention_scale,
            "embedding scale": self.embedding_scale,
            "residual scale": self.residual_scale,
            "logit scale": self.logit_scale,
        }
        for name, value in numbers.items():
            if not (math.isfinite(value) and value > 0):
                raise GgufError(f"the {name} {value} is not a positive number")
        if not (math.isfinite(self.clamp_kqv) and self.clamp_kqv >= 0):
            raise GgufError(f"attention.clamp_kqv {self.clamp_kqv} is not a number >= 0")
        for name, value in (("attention", self.attention_softcap), ("final logit", self.final_softcap)):
            if not (math.isfinite(value) and value >= 0):
                raise GgufError(f"the {name} softcap {value} is not a number >= 0")

    def _check_rotary(self) -> None:
        """Rotary embeddings over the whole head, or over an even part of it where the
        architecture rotates part of each head (Nemotron)."""
        if ARCHITECTURES[self.architecture].partial_rotary:
            if not (0 < self.rotary_dim <= self.head_size and self.rotary_dim % 2 == 0):
                raise GgufError(
                    f"rope.dimension_count = {self.rotary_dim} is not an even number from 2 to "
                    f"the head size {self.head_size}"
                )
        elif self.rotary_dim != self.head_size:  # llama.cpp asserts it for these architectures too
            raise GgufError(
                f"rope.dimension_count = {self.rotary_dim} is not the head size {self.head_size}: "
                "partial rotary embeddings are not supported"
            )
