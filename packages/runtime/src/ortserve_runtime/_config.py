"""Configuration of how models are loaded and run. Plain data; no HTTP concerns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from ._providers import Provider, check_provider
from .sources._names import CHECKPOINT_PRECISIONS, CheckpointPrecision

__all__ = ["EmbeddingConfig", "EngineName", "KvCacheDtype", "ModelConfig", "RerankConfig"]

EngineName = Literal["auto", "ort-cpu", "og-engine", "og-generator"]
ENGINES: tuple[EngineName, ...] = get_args(EngineName)
KvCacheDtype = Literal["auto", "fp16", "int8"]
KV_CACHE_DTYPES: tuple[KvCacheDtype, ...] = get_args(KvCacheDtype)


@dataclass(frozen=True, slots=True)
class EmbeddingConfig:
    """How embedding models batch, pool and normalise."""

    max_batch_size: int = 64
    """Inputs the batcher merges from concurrent requests before it runs them."""
    max_inputs: int = 2048
    """Inputs one request may carry (OpenAI's limit); more are refused untokenized."""
    max_request_tokens: int = 300_000
    """Tokens one request's inputs may have in all (OpenAI's limit); a request past it is
    refused as soon as its tokenizing passes it, before any run (2,048 inputs of 242
    tokens took 250 s of a 2-core machine's model time, every other request waiting)."""
    run_tokens: int = 256
    """Padded tokens per session run: merged inputs are sorted by length and cut into
    runs of at most this many (an input longer than this runs alone)."""
    max_wait_ms: float = 2.0
    """How long the batcher waits for more requests once one has arrived."""
    pooling: Literal["mean", "cls", "last"] | None = None
    """``None``: from the folder's 1_Pooling/config.json, else mean."""
    normalize: bool = True
    """L2-normalise the vectors (what sentence-transformers models expect)."""
    truncate: bool = False
    """Cut inputs longer than the model's limit instead of refusing them."""


@dataclass(frozen=True, slots=True)
class RerankConfig:
    """How rerank (cross-encoder) models batch, limit and score."""

    max_batch_size: int = 64
    """(query, document) pairs the batcher merges from concurrent requests before it runs them."""
    max_documents: int = 1000
    """Documents (pairs) one request may carry (Cohere's limit); more are refused untokenized."""
    run_tokens: int = 256
    """Padded tokens per session run, as :attr:`EmbeddingConfig.run_tokens` (the same
    default: on a noisy 2-core machine 256 and 512 measured alike for pairs of 10 to 90
    tokens, and both beat one padded run of 32 pairs)."""
    max_wait_ms: float = 2.0
    """How long the batcher waits for more requests once one has arrived."""
    truncate: bool = False
    """Cut pairs longer than the model's limit (longest first, as transformers'
    ``truncation=True``) instead of refusing them."""
    activation: Literal["sigmoid", "none"] | None = None
    """What turns the logit into the score: ``sigmoid`` (0 to 1) or ``none`` (the raw
    logit). ``None``: what sentence-transformers' CrossEncoder would apply, from the folder's
    config.json (sigmoid unless it names Identity)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_documents < 1 or self.run_tokens < 1:
            raise ValueError("max_batch_size, max_documents and run_tokens must be at least 1")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """How a model is run. One config may serve many models."""

    provider: Provider = "cpu"
    """Execution provider: ``cpu``, ``cuda``, ``dml``, ``qnn``, ``openvino``, ``webgpu`` or
    ``trt-rtx``. A provider that is not installed fails the load, naming what to install."""
    provider_options: dict[str, str] = field(default_factory=dict)
    """Options passed to the execution provider (for example ``device_id``)."""
    engine: EngineName = "auto"
    """What runs generation: ``ort-cpu`` (ortserve's continuous batching, CPU only),
    ``og-engine`` (``og.Engine``), ``og-generator`` (an ``og.Generator`` per request);
    ``auto`` picks from the provider and the folder (see the registry)."""
    session_options: dict[str, str] = field(default_factory=dict)
    """onnxruntime session config entries (``SessionOptions.add_session_config_entry``)."""
    intra_op_threads: int | None = None
    """Threads per onnxruntime call; ``None`` lets onnxruntime use every physical core."""
    max_batch_size: int = 32
    """Requests decoded together in one step (og-generator: generators stepped in turn);
    more wait in a queue. 32 from the measured curve (benchmarks/bench_concurrency.py, see
    docs/performance.md): with 8, the ninth request waits for whole generations (16 concurrent: TTFT p95
    22 s against 1.6 s with 32), while rows only cost memory when they hold tokens. og-engine batches what og schedules: 4 in its static batches
    on the CPU (measured: og's ``engine.static_batching.max_batch_size`` is reported but
    does not raise it), the folder's ``engine.dynamic_batching`` with paged attention."""
    max_sequence_length: int | None = 4096
    """Prompt plus completion tokens per request, capped by the model's context length.
    The key/value cache holds ``max_batch_size`` rows of this many tokens."""

    prefill_chunk_tokens: int = 512
    """Prompts longer than this are prefilled in chunks, with decode steps of the running
    requests in between (a long prompt does not stall the other streams)."""
    prefill_int8: bool | None = False
    """ort-cpu: prefill prompts of 64 tokens or more through an int8 copy of an int4 model's
    matrices (onnxruntime's u8s8 GEMM; the MLP's down projection and the LM head stay
    int4), converted at the model's first load and kept under ``$ORTSERVE_CACHE/int8-prefill``;
    decode stays on the folder's int4 graph. Measured (see docs/performance.md): prefill 1.4-1.6x faster,
    about 0.5 GB more memory on the 0.5B-shaped model, and greedy replies that drift from
    og's as far as any change of rounding does; activations are scaled per call, so a
    prompt's rows also depend on the chunk they are in and on a prefix-cache hit (the
    model's status says ``reproducible: False``). Hence off by default. ``None`` turns it on
    where the CPU has VNNI (AVX-512 VNNI or AVX-VNNI) for models that have int4 matrices;
    ``True`` for every model, refusing to load one it cannot apply to (another engine,
    another precision, every position's logits)."""
    reproducible: bool = False
    """ort-cpu: give a request the same tokens whatever the prefix cache holds and whoever
    runs beside it, at a cost. Off (the default), the fastest path: a finished reply's
    key/values, written by decode steps, serve a next turn at once (decode steps round
    differently from a prefill, so the next turn's logprobs move in the last bits), and a
    lone stream of a 4-bit model decodes alone; the model's status says ``reproducible:
    False``. On: only prefilled rows are kept (replies are prefilled again while the engine
    is idle) and, where onnxruntime's 4-bit matrix product rounds a lone row differently
    from the same row among others (AVX2 without AVX-512: up to 1.39 in a logprob,
    measured), a lone stream decodes beside a dummy row (13-32% fewer tokens/s, SmolLM2
    Q4_0 on 2 AVX2 cores, measured)."""
    prefix_cache_tokens: int = 16384
    """Tokens of earlier prompts and replies (a chat's history) whose key/value rows the
    ort-cpu engine keeps, so that a prompt
    starting the same way (the next turn of a chat, a shared system prompt) prefills only
    the rest; least recently used go first; 0 turns it off. Memory:
    this many tokens x layers x 2 x kv heads x head size x 4 bytes (fp32 caches)."""
    prefix_cache_mb: float | None = None
    """The prefix cache's budget in MiB of key/values instead of tokens (a token's bytes
    depend on the model: 46 KB on SmolLM2-135M at fp32); ``None``: ``prefix_cache_tokens``."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """ort-cpu: how the key/value cache (the running rows and the prefix cache) stores keys
    and values. ``auto``: the graph's own type (exact). ``fp16``: half the bytes of an fp32
    graph's. ``int8``: a quarter, each layer's keys and values scaled per channel with
    scales measured once by running a calibration text through the model (kept under
    ``$ORTSERVE_CACHE/kv-scales``). Attention still computes in the graph's type; the
    logprob drift measured on SmolLM2 is in docs/performance.md. Rounding happens as a row is
    written, so a request's output does not depend on a prefix-cache hit or its batch."""
    prefix_cache_min_tokens: int = 32
    """Shortest common prefix worth reusing."""
    multimodal_concurrency: int = 4
    """Requests a multimodal model runs at once, each on its own ``og.Generator`` with its own
    key/value cache (interleaved token by token); more wait in the queue."""
    max_images: int = 8
    """Images one request may carry."""
    max_image_pixels: int = 25_000_000
    """Largest image (width x height) accepted; larger ones are refused before decoding."""
    max_request_image_pixels: int = 40_000_000
    """Pixels of one request's images together, refused past it before decoding: the model's
    og process holds them all decoded at once (a 25-megapixel image +358 MiB, each more
    +120-160 MiB; eight took it +1.35 GiB: twenty-fourth probe, issue 45; two 25-megapixel
    WebPs with alpha +525-548 MiB on Qwen2.5-VL: twenty-seventh, where 25 + 15 megapixels
    take +406-454). A 25-megapixel image and a 15, three 12-megapixel photos."""
    max_audio_seconds: float = 2 * 60 * 60
    """Longest audio a speech model transcribes per request (2 hours: 240 of Whisper's
    windows, read one at a time); longer audio is refused before it is decoded."""
    max_request_audio_samples: int = 20 * 60 * 16_000
    """Samples of one request's audio clips together (frames x channels, at the clip's own
    rate; below 16 kHz, at 16 kHz) a multimodal model (Gemma 4, Phi-4-multimodal) takes:
    20 minutes of 16 kHz mono, 3:20 of 48 kHz stereo; refused past it from their headers,
    before any decode. Its og process holds each clip decoded whole (issue 45: an hour of
    16 kHz silence, a 180 KB FLAC, took it +416 MiB; half an hour of 48 kHz stereo
    +1.6 GiB). Gemma 4 hears a clip's first 30 seconds."""
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    rerank: RerankConfig = field(default_factory=RerankConfig)
    last_position_logits: bool = True
    """Compute logits for the last prompt position only (faster prefill; see _generation)."""
    chat_template: Path | None = None
    """A Jinja chat template file to render chats with instead of the folder's own (a model
    whose template has no tools, or none at all; as vLLM's ``--chat-template``). It is
    read and compiled when the model loads: a missing file or a template that does not
    parse fails that model's load, naming the file (and line)."""
    tools_in_system_prompt: bool = True
    """A model whose chat template knows no tools (SmolLM2's, many base and older models')
    gets a request's tools described in its system prompt and its calls parsed in the
    Hermes format (``<tool_call>{...}</tool_call>``; forced calls constrained by grammar),
    as LM Studio falls back to a default tool format; ``False`` refuses tool requests to
    such a model with a 400."""
    speculative: str | None = None
    """Speculative decoding: ``ngram`` drafts each request's next tokens by looking its last
    tokens up in its prompt and output (see chat/_drafts), checked in one model call;
    ort-cpu does it while a request runs alone (a separate call per request costs more
    than a batched step saves, measured), og-generator through onnxruntime-genai's own
    n-gram speculation. ``draft:FOLDER`` (ort-cpu): a smaller genai model with the same
    tokenizer drafts greedily. ``None``: only requests carrying a ``prediction`` speculate."""
    quantize: CheckpointPrecision | None = None
    """A transformers checkpoint (``config.json`` and safetensors) is built into a genai
    folder by og's builder at its first load, in this precision: ``int4`` (``None``: the
    default; k_quant with the most sensitive matrices in int8), ``int8``, ``fp16`` (GPU
    providers) or ``fp32``. Applies to checkpoints only: a model of another source with
    its own config saying it is refused."""
    adapters: dict[str, Path] = field(default_factory=dict)
    """LoRA adapters of a generative model: name -> ``.onnx_adapter`` file, made for this
    model's folder (its decoder takes the adapter's weights as inputs). A request picks one
    by name (:meth:`ChatModel.with_adapter`; over HTTP the model id ``MODEL:NAME``); without
    one it runs the base model. Loaded with the model; the names may not contain ``:``."""

    @property
    def draft_folder(self) -> Path | None:
        """The draft model's folder of ``speculative="draft:FOLDER"``."""
        if self.speculative is None or not self.speculative.startswith("draft:"):
            return None
        return Path(self.speculative.removeprefix("draft:")).expanduser()

    def __post_init__(self) -> None:
        check_provider(self.provider)
        if self.provider == "cpu" and self.provider_options:
            # Nothing on the CPU reads them: refuse rather than accept and ignore.
            raise ValueError(
                f"the CPU provider takes no provider options (got {', '.join(sorted(self.provider_options))})"
            )
        for name, value, choices in (
            ("engine", self.engine, ENGINES),
            ("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
            ("quantize", self.quantize, (None, *CHECKPOINT_PRECISIONS)),
        ):
            if value not in choices:
                named = ", ".join(c for c in choices if c is not None)
                raise ValueError(f"unknown {name} {value!r}; choose one of {named}")
        if self.speculative not in (None, "ngram") and self.draft_folder in (None, Path()):
            raise ValueError(f"unknown speculative method {self.speculative!r}; choose ngram or draft:FOLDER")
        if self.reproducible and (self.prefill_int8 is not False or self.speculative is not None):
            # Both make a request's rounding depend on what shares its calls: refused rather
            # than accepted and left unkept.
            raise ValueError(
                "reproducible cannot be kept with prefill_int8 (on or auto) or speculative decoding; turn those off"
            )
        for name in (
            "max_batch_size",
            "multimodal_concurrency",
            "prefill_chunk_tokens",
            "max_image_pixels",
            "max_request_image_pixels",
            "max_request_audio_samples",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.prefix_cache_mb is not None and not 0 <= self.prefix_cache_mb < float("inf"):
            raise ValueError(
                f"prefix_cache_mb must be a size in MiB, 0 or more (0 turns the cache off), got {self.prefix_cache_mb}"
            )
        if self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must not be negative (0 turns the cache off)")
        if self.max_images < 0:
            raise ValueError("max_images must not be negative (0 takes no images)")
        if not 0 < self.max_audio_seconds < float("inf"):  # inf would bound nothing
            raise ValueError("max_audio_seconds must be a positive number of seconds")
        if self.max_sequence_length is not None and self.max_sequence_length < 2:
            raise ValueError("max_sequence_length must be at least 2")
        for name in self.adapters:
            if not name or ":" in name:
                raise ValueError(
                    f"adapter name {name!r} must be non-empty and free of ':' (the model id is MODEL:NAME)"
                )
