"""``ort-cpu``: continuous batching of the genai builder's decoder graph on onnxruntime's
CPU provider.

Why not ``og.Engine`` or a batched ``og.Generator`` on the CPU (measured with
onnxruntime-genai 0.18, see docs/performance.md): the static Engine batches at most 4 requests and a
new request waits for the whole batch; a batched Generator takes every prompt at once and
its left padding gives wrong results for the padded rows of GQA models. So the decoder ONNX
graph the genai builder writes is driven directly with onnxruntime:

* one owner thread per model runs every session call; asyncio callers never block;
* each request owns one row of a key/value cache shared between past and present
  (GroupQueryAttention's share-buffer mode, as onnxruntime-genai does it), so a request
  joins the running batch after its own prefill and leaves it the step it finishes or is
  cancelled, freeing its row at once (continuous batching);
* sampling, stop strings and EOS handling run per request on the host, so requests with
  different options share one batch.

LongRoPE models (Phi-3.x, Phi-4-mini) take the short or the long rotary factors at each
call from the attention mask's width (see :func:`_longrope_window`), so the engine shapes its
calls as onnxruntime-genai's do: a prompt past the window in one call (the rest of it,
after a prefix-cache hit), a decode step per side of the window, and prefix-cache entries
reused only by prompts on their own side.

LoRA adapters (see :func:`_adapter_inputs`) are bound as extra inputs, one adapter per
session call: the rows are kept grouped by adapter (see :meth:`OrtCpuEngine._regroup`), so
a decode step makes one call per adapter in use, each batching all of that adapter's rows.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import mmap
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnx.helper
import onnx.numpy_helper
import onnxruntime as ort
from tokenizers import Tokenizer

from .._config import ModelConfig
from .._contract import EngineCapabilities, FinishReason, OwnerThread, Request, batched_hand_backs
from .._drafts import MAX_DRAFT_TOKENS
from .._errors import EngineError, ModelLoadError, PreemptedError
from .._folder import GenaiFolder
from ._int8_prefill import cpu_has_vnni, has_int4_matrices, int8_cache, int8_prefill_folder
from ._kv_storage import CALIBRATION_TEXT, KvScales, load_or_measure_scales, scales_from_cache, store_kv_as
from ._prefix_cache import PrefixCache, Rows

__all__ = ["NotDrivableError", "OrtCpuEngine"]

logger = logging.getLogger(__name__)

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}


class NotDrivableError(ModelLoadError):
    """The folder's decoder needs what the ort-cpu engine does not feed (its message says
    what); og's engines may run it."""


class _DecoderGraph:
    """The decoder ONNX graph and the names genai_config.json gives its inputs/outputs."""

    def __init__(self, folder: Path, genai: dict[str, Any], config: ModelConfig) -> None:
        self.config = config
        decoder = genai["model"]["decoder"]
        self.layers = int(decoder["num_hidden_layers"])
        self.kv_heads = int(decoder.get("num_key_value_heads", decoder["num_attention_heads"]))
        self.head_size = int(decoder["head_size"])
        names = decoder.get("inputs", {})
        outputs = decoder.get("outputs", {})
        past_key = names.get("past_key_names", "past_key_values.%d.key")
        past_value = names.get("past_value_names", "past_key_values.%d.value")
        present_key = outputs.get("present_key_names", "present.%d.key")
        present_value = outputs.get("present_value_names", "present.%d.value")
        self.cache_names = [
            (past_key % i, present_key % i, past_value % i, present_value % i) for i in range(self.layers)
        ]
        self.input_ids = names.get("input_ids", "input_ids")
        self.attention_mask = names.get("attention_mask", "attention_mask")
        self.position_ids = names.get("position_ids", "position_ids")
        self.logits = outputs.get("logits", "logits")
        sliding = decoder.get("sliding_window")
        sliding = sliding if isinstance(sliding, dict) else {}
        self.window_size = int(sliding.get("window_size") or 0)
        self.window_layers = set(sliding.get("layers", range(self.layers))) if self.window_size > 0 else set()
        """Sliding-window layers (Gemma 2's local ones) and their window: GroupQueryAttention
        keeps them in a ring (``sliding_window_cache``) that must hold at least the window."""

        model_path = folder / decoder.get("filename", "model.onnx")
        if not model_path.exists():
            raise ModelLoadError(f"{model_path} does not exist", path=model_path)
        try:
            # Weights stay on disk: the graph alone says how the session is opened and
            # whether the model uses LongRoPE.
            graph_model = onnx.load(str(model_path), load_external_data=False)
        except Exception as exc:  # onnx raises its own untyped errors for corrupt files
            raise ModelLoadError(f"{model_path} could not be loaded by onnxruntime: {exc}", path=model_path) from exc
        self.model_path = model_path
        reason = self._undrivable(graph_model.graph)
        if reason is not None:
            raise NotDrivableError(
                f"{model_path} is not a decoder the ort-cpu engine can drive: {reason}", path=model_path
            )
        self.layer_shapes = self._layer_shapes(graph_model.graph)
        """Per layer, its key/values' (heads, head size): Gemma 4's global layers have
        larger heads than its sliding ones; genai_config.json gives one size for all."""
        if config.kv_cache_dtype != "auto":
            self._store_kv_as(config.kv_cache_dtype, graph_model, folder / "tokenizer.json")
        self.int8_source = onnx.ModelProto()
        """The graph as read, for :meth:`open_int8_prefill` (the session below edits its copy)."""
        self.int8_source.CopyFrom(graph_model)
        self.rope_window = _longrope_window(graph_model.graph, self.attention_mask, model_path)
        """LongRoPE's original window: a call whose attention mask is wider uses the long
        rotary factors, otherwise the short ones; ``None`` for other models."""
        try:
            self.session, self.last_only = _open_session(
                model_path, graph_model, self._options(), self.logits, last_only=config.last_position_logits
            )
        except Exception as exc:  # onnx/onnxruntime raise their own untyped errors for corrupt files
            raise ModelLoadError(f"{model_path} could not be loaded by onnxruntime: {exc}", path=model_path) from exc
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.has_position_ids = self.position_ids in inputs
        self.ids_dtype, self.mask_dtype = self._index_dtypes(inputs)
        cache_type = inputs[self.cache_names[0][0]].type
        if cache_type not in _DTYPES:
            raise ModelLoadError(
                f"{model_path} has a key/value cache of unsupported type {cache_type}", path=model_path
            )
        self.cache_dtype = _DTYPES[cache_type]
        logits_output = next(o for o in self.session.get_outputs() if o.name == self.logits)
        self.logits_dtype = _DTYPES.get(logits_output.type, np.float32)
        vocab = logits_output.shape[-1]
        if not isinstance(vocab, int):
            self.last_only = False  # a symbolic vocabulary size: no fixed logits buffer
        self.vocab_size = vocab if isinstance(vocab, int) else 0

    def _layer_shapes(self, graph: onnx.GraphProto) -> list[tuple[int, int]]:
        """Each layer's (key/value heads, head size) from its past key input where the graph
        fixes them, else genai_config.json's."""
        inputs = {i.name: i for i in graph.input}
        shapes = []
        for past_key, _, _, _ in self.cache_names:
            dims = inputs[past_key].type.tensor_type.shape.dim
            fixed = [d.dim_value if d.HasField("dim_value") else None for d in dims]
            heads = fixed[1] if len(fixed) == 4 and fixed[1] else self.kv_heads
            head_size = fixed[3] if len(fixed) == 4 and fixed[3] else self.head_size
            shapes.append((heads, head_size))
        return shapes

    def _undrivable(self, graph: onnx.GraphProto) -> str | None:
        """Why this engine cannot drive ``graph`` (read before any session opens), or ``None``.

        It feeds token ids, the attention mask, position ids and one key/value cache per
        layer, written in place by GroupQueryAttention, nothing else: a graph needing another
        input (LFM2's convolution state, Qwen3.5's linear-attention state, ``inputs_embeds``
        of a multimodal decoder), position ids of another rank (Qwen VL's 3-D MRoPE) or
        another attention operator runs on og instead. Inputs with a default (an
        initializer of the same name, as LoRA inputs have) are optional.
        """
        defaults = {tensor.name for tensor in graph.initializer}
        inputs = {i.name: i for i in graph.input if i.name not in defaults}
        cache = {name for names in self.cache_names for name in (names[0], names[2])}
        needed = [self.input_ids, self.attention_mask, *sorted(cache)]
        missing = [name for name in needed if name not in inputs]
        unknown = sorted(set(inputs) - {*needed, self.position_ids})
        if missing or unknown:
            return ", ".join(
                ([f"it lacks the inputs {missing}"] if missing else [])
                + ([f"it needs inputs the engine does not feed {unknown}"] if unknown else [])
            )
        positions = inputs.get(self.position_ids)
        rank = len(positions.type.tensor_type.shape.dim) if positions is not None else 2
        if rank != 2:
            return f"its position ids have rank {rank} (multimodal rotary positions), not 2"
        attention = sorted({node.op_type for node in graph.node if node.op_type.endswith("Attention")})
        if attention != ["GroupQueryAttention"]:
            # The builder's fp16 CPU graphs use MultiHeadAttention, which concatenates past and
            # new key/values into a new tensor each call; the engine's rows are written in place.
            return f"its attention runs as {attention or 'no attention operator'}, not GroupQueryAttention alone"
        return None

    def _store_kv_as(self, kv_cache_dtype: str, graph_model: onnx.ModelProto, tokenizer: Path) -> None:
        """Edit ``graph_model`` to keep its key/value cache as ``kv_cache_dtype`` (see
        _kv_storage), measuring int8 scales where no earlier load kept them."""
        inputs = {i.name: i for i in graph_model.graph.input}
        native = inputs[self.cache_names[0][0]].type.tensor_type.elem_type
        quantized = [
            node.name
            for node in graph_model.graph.node
            if node.op_type == "GroupQueryAttention" and any(a.name.endswith("_quant_type") for a in node.attribute)
        ]
        if quantized or native not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            raise ModelLoadError(
                f"{self.model_path}: kv_cache_dtype={kv_cache_dtype} (--kv-cache-dtype) needs a graph whose "
                f"key/value cache is fp32 or fp16, and this one keeps {onnx.helper.tensor_dtype_to_string(native)}"
                f"{' already quantized' if quantized else ''}; use auto for this model",
                path=self.model_path,
            )
        if kv_cache_dtype == "fp16":
            if native == onnx.TensorProto.FLOAT:  # an fp16 graph keeps fp16 already
                store_kv_as(graph_model, self.cache_names, onnx.TensorProto.FLOAT16)
            return
        scales = load_or_measure_scales(
            self.model_path, graph_model, lambda: self._measure_kv_scales(graph_model, tokenizer)
        )
        store_kv_as(graph_model, self.cache_names, onnx.TensorProto.INT8, scales)

    def _measure_kv_scales(self, graph_model: onnx.ModelProto, tokenizer: Path) -> KvScales:
        """int8 scales from the keys and values the unchanged graph writes for the
        calibration text (a session of its own, closed here)."""
        logger.info("%s: measuring int8 key/value scales (once per model)", self.model_path)
        unchanged = onnx.ModelProto()
        unchanged.CopyFrom(graph_model)
        # Logits of the last position only: every position's cost 1 s of the 1.4 s run on SmolLM2.
        session, last_only = _open_session(self.model_path, unchanged, self._options(), self.logits, last_only=True)
        inputs = {i.name: i for i in session.get_inputs()}
        ids_dtype, mask_dtype = self._index_dtypes(inputs)
        cache_dtype = _DTYPES[inputs[self.cache_names[0][0]].type]
        ids = Tokenizer.from_file(str(tokenizer)).encode(CALIBRATION_TEXT).ids
        count = len(ids)
        cache = []
        for layer, (heads, head_size) in enumerate(self.layer_shapes):
            length = max(count, self.window_size if layer in self.window_layers else 0)
            shape = (1, heads, length, head_size)
            cache.append((np.zeros(shape, cache_dtype), np.zeros(shape, cache_dtype)))
        binding = session.io_binding()
        binding.bind_cpu_input(self.input_ids, np.asarray([ids], dtype=ids_dtype))
        binding.bind_cpu_input(self.attention_mask, np.ones((1, count), dtype=mask_dtype))
        if self.position_ids in inputs:
            binding.bind_cpu_input(self.position_ids, np.arange(count, dtype=ids_dtype)[None, :])
        self.bind_cache(binding, cache, slice(0, 1))
        if last_only:
            binding.bind_cpu_input(LOGIT_POSITIONS, _LAST_POSITION)
        binding.bind_output(self.logits)
        session.run_with_iobinding(binding)
        interleaved = any(
            attribute.name in ("rotary_interleaved", "interleaved") and attribute.i == 1
            for node in graph_model.graph.node
            if node.op_type in ("GroupQueryAttention", "RotaryEmbedding")
            for attribute in node.attribute
        )
        return [
            scales_from_cache(
                keys[:, :, :count].astype(np.float32),
                values[:, :, :count].astype(np.float32),
                interleaved=interleaved,
            )
            for keys, values in cache
        ]

    def _index_dtypes(self, inputs: Mapping[str, Any]) -> tuple[Any, Any]:
        """The integer types of a session's token ids and attention mask (int32 or int64)."""

        def integer(name: str) -> Any:
            return np.int32 if inputs[name].type == "tensor(int32)" else np.int64

        return integer(self.input_ids), integer(self.attention_mask)

    def _options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        if self.config.intra_op_threads is not None:
            options.intra_op_num_threads = self.config.intra_op_threads
        options.inter_op_num_threads = 1
        for key, value in self.config.session_options.items():
            options.add_session_config_entry(key, value)
        return options

    def bind_cache(self, binding: Any, cache: list[tuple[Any, Any]], rows: slice) -> None:
        """Bind the key/value ``cache`` rows ``rows`` as both past and present of every layer:
        GroupQueryAttention appends in place (share-buffer mode)."""
        for (past_k, present_k, past_v, present_v), (keys, values) in zip(self.cache_names, cache, strict=True):
            key_value = ort.OrtValue.ortvalue_from_numpy(keys[rows])
            value_value = ort.OrtValue.ortvalue_from_numpy(values[rows])
            binding.bind_ortvalue_input(past_k, key_value)
            binding.bind_ortvalue_output(present_k, key_value)
            binding.bind_ortvalue_input(past_v, value_value)
            binding.bind_ortvalue_output(present_v, value_value)

    def open_int8_prefill(self) -> Any:
        """A session of the int8 copy of this graph (see _int8_prefill; the engine asks only
        where :func:`has_int4_matrices` and ``last_only``), or ``None`` where no weight could
        be read for it."""
        source = self.int8_source
        del self.int8_source  # read once
        try:
            folder = int8_prefill_folder(self.model_path, source, int8_cache())
        except OSError as exc:  # a read-only cache: a copy for this load only
            logger.warning("no int8 prefill cache at %s (%s): converting into a temporary folder", int8_cache(), exc)
            scratch = tempfile.mkdtemp(prefix="ortserve-int8-")
            weakref.finalize(self, shutil.rmtree, scratch, True)  # removed with this graph
            folder = int8_prefill_folder(self.model_path, source, Path(scratch))
        if folder is None:
            return None
        graph_model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        session, _ = _open_session(folder / "model.onnx", graph_model, self._options(), self.logits, last_only=True)
        return session


class OrtCpuEngine(OwnerThread):
    """Continuous batching on the CPU provider (see the module docstring)."""

    name = "ort-cpu"
    provider = "cpu"
    capabilities = EngineCapabilities(
        host_sampling=True, seeds=True, media=False, batching="continuous", reproducible=True, drafts=True
    )

    def __init__(
        self,
        model_name: str,
        folder: GenaiFolder,
        config: ModelConfig,
        max_sequence_length: int,
        adapters: Mapping[str, Path] | None = None,
    ) -> None:
        if config.provider != "cpu":
            raise ModelLoadError(
                f"the ort-cpu engine runs on the CPU provider only, not {config.provider!r}; "
                "use --engine og-engine or og-generator (or auto) for other providers",
                path=folder.path,
            )
        if folder.is_multimodal or folder.is_encoder_decoder:
            raise ModelLoadError(
                f"{folder.path} is a multimodal or encoder-decoder model ({folder.model_type}); "
                "the ort-cpu engine runs decoder-only text models (use og-generator)",
                path=folder.path,
            )
        super().__init__(model_name)
        self._graph = _DecoderGraph(folder.path, folder.genai, config)
        self._draft = _DraftModel(folder, config, max_sequence_length) if config.draft_folder is not None else None
        """The draft model of ``speculative="draft:FOLDER"``."""
        self._adapter_inputs = _adapter_inputs(adapters or {})
        """Adapter tensors by adapter key; replaced, never changed in place (see :meth:`add_adapter`)."""
        self._retired: set[str] = set()
        """Adapter keys to forget once no request uses them (see :meth:`retire_adapter`)."""
        self.max_batch_size = config.max_batch_size
        graph = self._graph
        # np.zeros maps untouched pages lazily: memory grows with the tokens actually cached.
        # A sliding layer's ring is a whole row too (it never wraps, so rows can be copied
        # like any other), but GQA refuses one shorter than the window.
        self._cache = []
        for layer, (heads, head_size) in enumerate(graph.layer_shapes):
            length = max(max_sequence_length, graph.window_size if layer in graph.window_layers else 0)
            shape = (self.max_batch_size, heads, length, head_size)
            self._cache.append((_unhuged_zeros(shape, graph.cache_dtype), _unhuged_zeros(shape, graph.cache_dtype)))
        self._rows_touched = 0
        """Rows written since their pages were last given back (see :meth:`_give_back_rows`)."""
        self._rows: list[Request] = []
        self._prefilling: Request | None = None
        """The request whose prompt is going into the cache, at row ``len(self._rows)``."""
        self._refills: collections.deque[_Refill] = collections.deque(maxlen=_REFILLS)
        """Finished requests whose prompt and reply are to be prefilled for the prefix cache
        while the engine is idle (see :meth:`_refill_step`); newest last."""
        self._refilling: _Refill | None = None
        """The refill going into row 0 now."""
        self.prefill_chunk = config.prefill_chunk_tokens
        self.kv_cache_dtype = np.dtype(graph.cache_dtype).name
        """What the key/value cache stores (``ModelConfig.kv_cache_dtype``, or the graph's type)."""
        token_bytes = 2 * sum(h * size for h, size in graph.layer_shapes) * np.dtype(graph.cache_dtype).itemsize
        self._token_bytes = token_bytes
        budget = config.prefix_cache_tokens
        if config.prefix_cache_mb is not None:
            budget = int(config.prefix_cache_mb * 2**20) // token_bytes
        self.prefix_cache = PrefixCache(budget, config.prefix_cache_min_tokens, token_bytes)
        """Key/value rows of earlier prompts (see _prefix_cache); owner thread only."""
        self._bindings: dict[tuple[int, int, str | None, int, bool], Any] = {}
        """IO bindings by row range, adapter, session and logits buffer (see :meth:`_bind`)."""
        self._logits = (
            _unhuged_zeros((self.max_batch_size, 1, graph.vocab_size), graph.logits_dtype) if graph.last_only else None
        )
        """Where the decoder writes next-token logits, a row per cache row, when it computes
        the last position's only (their shape is then fixed)."""
        self._shrink_arena = ort.RunOptions()
        self._shrink_arena.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self.steps = 0
        """Decoder runs so far (prefills plus batched decode steps); for tests and metrics."""
        self.background_yields = 0
        """Times a background request gave way to an interactive one (its prefill parked, or
        its row given up); for tests and metrics."""
        self.draft_tokens = 0
        """Draft tokens checked so far (speculative decoding, see :meth:`_speculate`)."""
        self.accepted_draft_tokens = 0
        """Draft tokens that became output tokens."""
        self.prefill_session: Any = None
        """The int8 prefill session, where ``ModelConfig.prefill_int8`` asks for one."""
        int4 = has_int4_matrices(graph.int8_source)
        convertible = graph.last_only and int4
        self._pad_lone_row = int4 and _lone_row_rounds_differently()
        """Decode a lone row beside a dummy (see :meth:`_decode_rows`)."""
        if config.prefill_int8 and not convertible:
            raise ModelLoadError(
                f"{folder.path}: prefill_int8 (--prefill-int8 on) needs an int4 model (4-bit MatMulNBits) whose "
                "logits are computed for the last position only; this one has nothing to convert "
                "(turn it off for this model, or use --prefill-int8 auto, which skips such models)",
                path=folder.path,
            )
        if config.prefill_int8 and not cpu_has_vnni():
            # Without VNNI onnxruntime's u8s8 GEMM adds u8 x s8 products in pairs in 16 bits
            # (AVX2's vpmaddubsw), which saturate: measured on an AVX2-only EPYC, a 72 x 24
            # product came out 14% off (of its largest value); and it would not be faster.
            raise ModelLoadError(
                f"{folder.path}: prefill_int8 (--prefill-int8 on) needs a CPU with VNNI (AVX-512 VNNI or "
                "AVX-VNNI), and this one has none: its int8 products would saturate; turn it off, or use "
                "--prefill-int8 auto, which turns it on where the CPU has VNNI",
                path=folder.path,
            )
        wanted = config.prefill_int8 if config.prefill_int8 is not None else cpu_has_vnni()
        if wanted and convertible:
            # Part of the load (seconds; the first load of a model also converts it), so that
            # the memory measured around the load counts it, and no later load's does.
            try:
                self.prefill_session = graph.open_int8_prefill()
            except Exception as exc:  # an unusual graph, a full disk
                if config.prefill_int8:  # asked for by name: a load error saying why, not a silent int4
                    raise ModelLoadError(
                        f"{folder.path}: prefill_int8 (--prefill-int8 on): no int8 copy could be made "
                        f"({type(exc).__name__}: {exc}); turn it off, or use --prefill-int8 auto, which serves "
                        "without it",
                        path=folder.path,
                    ) from exc
                logger.warning("model %r: no int8 prefill session, prompts prefill in int4", model_name, exc_info=True)
            finally:
                _release_freed_memory()  # the conversion's buffers
            if self.prefill_session is None and config.prefill_int8:
                raise ModelLoadError(
                    f"{folder.path}: prefill_int8 (--prefill-int8 on): none of its int4 matrices could be read "
                    "for an int8 copy; turn it off, or use --prefill-int8 auto",
                    path=folder.path,
                )
        else:
            del graph.int8_source
        if self.prefill_session is not None or config.speculative is not None:
            # int8 prefill: one activation scale per call, a row's rounding depends on the rows
            # beside it. Speculation: a request checks drafts while it runs alone, and a
            # draft's rows round as a prompt's do, a decode step's otherwise.
            self.capabilities = dataclasses.replace(self.capabilities, reproducible=False)
        self._start_thread()

    def add_adapter(self, key: str, path: Path) -> None:
        """Make LoRA adapter ``key`` (a checked ``.onnx_adapter`` file) usable by requests
        submitted from now on; any thread. The table is replaced, not changed in place, so
        the owner thread reads either table whole."""
        self._adapter_inputs = {**self._adapter_inputs, **_adapter_inputs({key: path})}

    def retire_adapter(self, key: str) -> None:
        """Forget adapter ``key`` once the requests using it are over (they finish with it);
        any thread. Keys are never reused (the model gives a re-added name a new key), so no
        binding or prefix-cache row of the old adapter can serve a new one."""
        with self._cond:
            self._retired.add(key)
            self._cond.notify()

    def _forget_retired_adapters(self) -> None:
        """Owner thread, under the lock: drop retired adapters no request holds any more."""
        held = [*self._inbox, *self._rows, *([self._prefilling] if self._prefilling else [])]
        in_use = {request.adapter for request in held}
        gone = self._retired - in_use
        if gone:
            self._adapter_inputs = {k: v for k, v in self._adapter_inputs.items() if k not in gone}
            for binding in [b for b in self._bindings if b[2] in gone]:
                del self._bindings[binding]
        self._retired &= in_use

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache's full capacity (its pages become resident as tokens are cached)."""
        return sum(key.nbytes + value.nbytes for key, value in self._cache)

    @property
    def live_kv_bytes(self) -> int:
        """Key/value bytes the running requests' rows hold (their tokens so far)."""
        held = [*self._rows, *([self._prefilling] if self._prefilling is not None else [])]
        return sum(request.length for request in held) * self._token_bytes

    @property
    def active(self) -> int:
        """Requests holding a batch row now (decoding, or having their prompt prefilled)."""
        return len(self._rows) + (self._prefilling is not None)

    @property
    def refilling(self) -> bool:
        """Whether finished replies are still to go into the prefix cache (see
        :meth:`_refill_step`): until then a next turn prefills them itself."""
        return bool(self._refills) or self._refilling is not None

    # -- owner thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._has_work() or self._closing):
                    self._cond.wait()
                if self._closing:
                    break
                if self._retired:
                    self._forget_retired_adapters()
                cancels, self._cancels = self._cancels, set()
                for request in cancels:
                    if request in self._inbox:
                        self._inbox.remove(request)
                        request.deliver(request.final("cancelled"))
            for request in cancels:
                if request is self._prefilling:
                    self._prefilling, request.row = None, -1
                    request.deliver(request.final("cancelled"))
                elif request.row >= 0:
                    self._finish(request, "cancelled")
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001  # an onnxruntime failure: fail the requests it touched
                failed = [*self._rows, *([self._prefilling] if self._prefilling else [])]
                self._prefilling = self._refilling = None
                self.prefix_cache.clear()  # a failed run may have left rows half written
                for request in failed:
                    if request in self._rows:
                        self._release(request, keep=False)
                    request.row = -1
                    request.deliver(EngineError(f"generation failed: {exc}"))
        error = self._closed_error()
        for request in [*self._inbox, *self._rows, *([self._prefilling] if self._prefilling else [])]:
            request.deliver(error)
        self._inbox.clear()
        self._rows.clear()
        self._prefilling = None

    def _has_work(self) -> bool:
        return bool(
            self._inbox
            or self._rows
            or self._prefilling
            or self._cancels
            or self._retired
            or self._refills
            or self._refilling
        )

    def _step(self) -> None:
        """One turn of the engine: prefill what waits, then a decode step of the running
        requests, or, with nothing else to do, a chunk of a refill."""
        if self._refilling is not None and self._inbox:
            self._stop_refill()  # a request came: it takes the row
        self._prefill_work()  # first tokens go out as each prompt is done
        if self._rows:
            with batched_hand_backs():  # one event-loop wake-up for the whole step
                self._decode_step()
        elif self._prefilling is None and not self._inbox and (self._refilling or self._refills):
            self._refill_step()

    def _prefill_work(self) -> None:
        """Put waiting prompts into the cache, one chunk at a time.

        Prompts that fit in a chunk are admitted back to back (low time to first token
        when many arrive together). A longer prompt takes one chunk per engine step, with
        a decode step of the running requests in between, so their streams keep flowing.
        """
        while True:
            if self._prefilling is not None and self._prefilling.options.background:
                self._park_background_prefill()
            if self._prefilling is None:
                with self._cond:
                    waiting = self._inbox[0] if self._inbox and len(self._rows) >= self.max_batch_size else None
                if waiting is not None and not waiting.options.background:
                    self._preempt_background()
                with self._cond:
                    if not self._inbox or len(self._rows) >= self.max_batch_size:
                        return
                    request = self._inbox.popleft()
                if request.cancelled:
                    request.deliver(request.final("cancelled"))
                    continue
                if request.adapter is not None and request.adapter not in self._adapter_inputs:
                    # submitted with an adapter unloaded meanwhile (a retired one waits for
                    # the requests already here): this request alone fails
                    request.deliver(EngineError(f"LoRA adapter {request.adapter!r} was unloaded"))
                    continue
                request.row, request.prefilled = len(self._rows), 0
                self._rows_touched = max(self._rows_touched, request.row + 1)
                self._reuse_prefix(request)
                self._prefilling = request
            request = self._prefilling
            logits = self._prefill_chunk(request, _BACKGROUND_CHUNK if request.options.background else None)
            if logits is None:
                if self._rows:
                    return  # a long prompt: let the running requests take a step
                continue
            self._prefilling = None
            self._remember(request)  # others may share this prompt's beginning
            self._rows.append(request)
            self._accept(request, logits)

    def _park_background_prefill(self) -> None:
        """An interactive request waits while a background prompt goes in: the background one
        goes back to the queue behind it, what it prefilled kept in the prefix cache (its next
        turn starts from there), so the interactive prompt waits one chunk at most."""
        request = self._prefilling
        with self._cond:
            if request is None or not self._inbox or self._inbox[0].options.background:
                return
        if request.prefilled:
            self._remember(request, request.prefilled)
        self._prefilling, request.row = None, -1
        self.background_yields += 1
        with self._cond:
            first = next((i for i, queued in enumerate(self._inbox) if queued.options.background), len(self._inbox))
            self._inbox.insert(first, request)

    def _preempt_background(self) -> None:
        """Free a row for an interactive request that waits with every row taken: the
        background request with the fewest tokens so far gives its row up (its prompt stays
        in the prefix cache for its next run)."""
        victims = [request for request in self._rows if request.options.background]
        if not victims:
            return
        victim = min(victims, key=lambda request: len(request.tokens))
        victim.cancelled = True  # no refill of a reply nobody gets
        self._release(victim)
        self.background_yields += 1
        victim.deliver(PreemptedError(f"model {self.model_name!r}: gave its batch row to an interactive request"))

    def _refill_step(self) -> None:
        """While nothing else runs: prefill one chunk of the newest finished request's prompt
        and reply, and keep them in the prefix cache once done.

        A reply's key/values are written by decode steps and never kept (see _prefix_cache),
        so a chat's next turn would prefill the reply again before its first token. Done
        here, while the user reads the reply, the next turn finds it in the cache as a cold
        prefill would have computed it. Small chunks, so that a request arriving meanwhile
        waits one chunk at most; it then takes the row, and what was prefilled so far is
        kept (:meth:`_stop_refill`). LongRoPE models get none: a prompt and reply past the
        window would need one call from the first token (see :meth:`_prefill_chunk`).
        """
        refill = self._refilling or self._refills.pop()
        if refill.adapter is not None and refill.adapter not in self._adapter_inputs:
            self._refilling = None  # its adapter was unloaded (checked each chunk: it may go between two)
            return
        if refill is not self._refilling:
            self._refilling = refill
            refill.row = 0
            self._rows_touched = max(self._rows_touched, 1)
            self._reuse_prefix(refill, count=False)
        if self._prefill_chunk(refill, _REFILL_CHUNK) is not None:
            self._refilling = None
            self._remember(refill)
            self._give_back_rows(0)

    def _stop_refill(self) -> None:
        """Give the row of the refill under way to a request; keep what it prefilled."""
        refill, self._refilling = self._refilling, None
        if refill is not None and refill.prefilled > 0:
            self._remember(refill, refill.prefilled)

    def _past_window(self, length: int) -> bool:
        """Whether a call whose attention mask is ``length`` wide uses LongRoPE's long factors."""
        window = self._graph.rope_window
        return window is not None and length > window

    def _call_group(self, request: Request) -> tuple[bool, str]:
        """Rows decoded in one session call share this: the LongRoPE side (rows within the
        window sort first), and the adapter (``""``: the base model)."""
        return self._past_window(request.length), request.adapter or ""

    def _cache_group(self, request: Request | _Refill) -> str:
        """The prefix-cache group of ``request``'s row: og computes a LongRoPE prompt past the
        window with the long factors throughout, one within it with the short ones;
        key/values computed through an adapter serve only that adapter; and those of a
        request with a ``cache_salt`` only requests with the same salt."""
        rope = "long-rope" if self._past_window(len(request.prompt)) else ""
        group = f"{rope}:{request.adapter}" if request.adapter is not None else rope
        salt = request.cache_salt if isinstance(request, _Refill) else request.options.cache_salt
        if salt is not None:  # kept as a digest: the cache holds no caller's secret
            group += ":salt:" + hashlib.sha256(salt.encode()).hexdigest()
        return group

    def _reuse_prefix(self, request: Request | _Refill, *, count: bool = True) -> None:
        """Copy the longest cached prefix of ``request``'s prompt into its row (``count``:
        in the cache's hit and miss figures)."""
        if self._odd_long_rope(request):
            return  # its last row is computed alone in a block (see _odd_long_rope): always cold
        entry, length = self.prefix_cache.lookup(request.prompt, self._cache_group(request), count=count)
        if entry is None:
            return
        for (keys, values), (cached_keys, cached_values) in zip(self._cache, entry.rows, strict=True):
            keys[request.row, :, :length] = cached_keys[:, :length]
            values[request.row, :, :length] = cached_values[:, :length]
        request.prefilled = request.cached_tokens = length

    def _odd_long_rope(self, request: Request | _Refill) -> bool:
        """Whether ``request``'s prompt is past LongRoPE's window by one token, and odd: the
        only prompt that cannot be prefilled in calls of an even number of rows (see
        :func:`_even_call`), since any first call shorter than the whole prompt would be
        within the window. Its last row is then computed alone, so it is neither reused from
        the cache nor kept in it."""
        length = len(request.prompt)
        return length % 2 == 1 and self._past_window(length) and not self._past_window(length - 1)

    def _remember(self, request: Request | _Refill, count: int | None = None) -> None:
        """Keep the key/values of ``request``'s prompt (its first ``count`` tokens; the start
        of its row) in the cache, in its group (LongRoPE: a prompt past the window was
        computed with the long factors throughout, one within it with the short ones)."""
        tokens = request.prompt[:count]
        group = self._cache_group(request)
        if self._odd_long_rope(request):
            tokens = tokens[:-1]
        row = request.row

        def copy_rows(count: int) -> Rows:
            return [(keys[row, :, :count].copy(), values[row, :, :count].copy()) for keys, values in self._cache]

        self.prefix_cache.store(tokens, copy_rows, group)

    def _bind(
        self,
        rows: slice,
        input_ids: npt.NDArray[Any],
        mask: npt.NDArray[Any],
        positions: Any,
        adapter: str | None,
        session: Any = None,
        *,
        every_position: bool = False,
    ) -> Any:
        """Run the decoder (``session``, else the folder's graph) on the cache rows ``rows``
        through ``adapter`` (``None``: the base model) and return the logits: of the last
        position, or (``every_position``, one row) of each position of ``input_ids``.

        The cache, logits and adapter bindings of a row range are made once and reused while
        the range (and adapter) stays the same (a decode step of an unchanged batch, the
        chunks of one prefill): only the inputs change from call to call. Building them anew
        took 48 OrtValues and 100 bind calls a step for a 24-layer model.
        """
        graph = self._graph
        session = session or graph.session
        fixed_logits = self._logits is not None and not every_position
        key = (rows.start, rows.stop, adapter, id(session), fixed_logits)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self._new_binding(rows, adapter, session, fixed_logits)
        binding.bind_cpu_input(graph.input_ids, input_ids)
        binding.bind_cpu_input(graph.attention_mask, mask)
        if graph.has_position_ids:
            binding.bind_cpu_input(graph.position_ids, positions)
        if graph.last_only:
            chosen = np.arange(input_ids.shape[1], dtype=np.int64) if every_position else _LAST_POSITION
            binding.bind_cpu_input(LOGIT_POSITIONS, chosen)
        if not fixed_logits:
            binding.bind_output(graph.logits)  # their shape varies
        # After a long prompt's chunk, hand the arena's large buffers back (onnxruntime keeps
        # what the largest call needed otherwise: measured +220 MB after a 4,096-token prompt).
        shrink = self._shrink_arena if input_ids.shape[1] >= _SHRINK_AFTER_TOKENS else None
        session.run_with_iobinding(binding, shrink)
        if shrink is not None:
            _release_freed_memory()  # what the arena gave back stays in the C heap otherwise
        self.steps += 1
        if fixed_logits and self._logits is not None:
            # Views into the engine's buffer: each caller samples from them before the
            # next call over the same rows overwrites them.
            return self._logits[rows]
        logits: npt.NDArray[np.float32] = binding.get_outputs()[-1].numpy()
        return logits

    def _new_binding(self, rows: slice, adapter: str | None, session: Any, fixed_logits: bool) -> Any:
        graph = self._graph
        if len(self._bindings) >= 2 * self.max_batch_size:
            self._bindings.clear()  # ranges churn as requests come and go; keep the map small
        binding = session.io_binding()
        graph.bind_cache(binding, self._cache, rows)
        # An unbound LoRA input takes its default (the base model): a binding keeps the
        # adapter it was made with, so bindings are kept per adapter too.
        for name, tensor in self._adapter_inputs[adapter].items() if adapter is not None else ():
            binding.bind_ortvalue_input(name, tensor)
        if fixed_logits:
            assert self._logits is not None
            binding.bind_ortvalue_output(graph.logits, ort.OrtValue.ortvalue_from_numpy(self._logits[rows]))
        return binding

    def _prefill_chunk(self, request: Request | _Refill, chunk: int | None = None) -> npt.NDArray[np.float32] | None:
        """Cache the next chunk (``chunk`` tokens, else ``prefill_chunk_tokens``) of the
        prompt; the last chunk returns the logits.

        A LongRoPE prompt past the window goes in one call, as og prefills it (after a
        prefix-cache hit, all the rest in one): chunks ending within the window would be
        computed with the short factors, og's with the long ones.
        """
        graph = self._graph
        start = request.prefilled
        end = min(len(request.prompt), start + (chunk or self.prefill_chunk))
        long_rope = self._past_window(len(request.prompt))
        if long_rope:
            end = len(request.prompt)
        even_start, even_end = _even_call(start, end, len(request.prompt))
        if not long_rope or self._past_window(even_end):  # a first call stays past the window
            start, end = even_start, even_end
        ids = np.asarray([request.prompt[start:end]], dtype=graph.ids_dtype)
        # The mask spans everything cached so far: GQA appends the chunk after it.
        mask = np.ones((1, end), dtype=graph.mask_dtype)
        positions = np.arange(start, end, dtype=graph.ids_dtype)[None, :]
        session = self.prefill_session if end - start >= _INT8_PREFILL_MIN_TOKENS else None
        logits = self._bind(slice(request.row, request.row + 1), ids, mask, positions, request.adapter, session)
        request.prefilled = end
        return logits[0, -1] if end == len(request.prompt) else None

    def _decode_step(self) -> None:
        if len(self._rows) == 1 and not self._inbox and self._prefilling is None:
            request = self._rows[0]
            if request.drafter is not None and self._speculate(request):
                return
        if self._graph.rope_window is not None or self._adapter_inputs:
            self._regroup()
        rows = list(self._rows)
        # The batch's mask is as wide as its longest row, and a LongRoPE graph picks its
        # factors from that width: rows within the window and rows past it (og decodes each
        # with its own length) go in separate calls, one per run of neighbouring rows
        # (one run per side after _regroup); so do rows of different adapters.
        logits: list[npt.NDArray[np.float32]] = []
        start = 0
        for end in range(1, len(rows) + 1):
            if end == len(rows) or self._call_group(rows[end]) != self._call_group(rows[start]):
                logits.extend(self._decode_rows(rows[start:end], start))
                start = end
        # Only now: a request finishing here frees its row and moves another into it.
        for request, row_logits in zip(rows, logits, strict=True):
            if not request.cancelled:
                self._accept(request, row_logits)

    def _decode_rows(self, rows: list[Request], first: int) -> npt.NDArray[np.float32]:
        """The next-token logits of ``rows``, which sit at batch rows ``first`` onwards."""
        graph = self._graph
        lengths = np.fromiter((r.length for r in rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter((r.tokens[-1] for r in rows), dtype=graph.ids_dtype, count=len(rows))[:, None]
        # Each row's new token sits right after its own cached tokens (right-aligned cache).
        width = int(lengths.max())
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(graph.mask_dtype)
        positions = (lengths - 1).astype(graph.ids_dtype)[:, None]
        count = len(rows)
        dummy = self._dummy_length(first + 1) if count == 1 and self._pad_lone_row else None
        if dummy is not None:
            # A lone row goes with a dummy in the row after it: onnxruntime's int4 MatMul
            # multiplies one row by another kernel than several, which rounds differently
            # (see _lone_row_rounds_differently).
            width = max(width, dummy)
            lengths = np.asarray([lengths[0], dummy])
            ids = np.concatenate([ids, ids])
            mask = (np.arange(width)[None, :] < lengths[:, None]).astype(graph.mask_dtype)
            positions = (lengths - 1).astype(graph.ids_dtype)[:, None]
            count = 2
        rows_slice = slice(first, first + count)
        logits: npt.NDArray[np.float32] = self._bind(rows_slice, ids, mask, positions, rows[0].adapter)[: len(rows), -1]
        return logits

    def _dummy_length(self, row: int) -> int | None:
        """The length a dummy in cache row ``row`` may have without changing anything read
        later: 1 in a free row; in the row whose prompt is going in, one past what is in,
        which the prompt's next chunk writes again. ``None``: no such row."""
        if row >= self.max_batch_size:
            return None
        pending = self._prefilling
        if pending is not None and pending.row == row:
            return int(pending.prefilled) + 1
        return 1 if row >= len(self._rows) + (pending is not None) else None

    def _speculate(self, request: Request) -> bool:
        """Check a draft of ``request``'s next tokens in one call, if one is worth it, and
        take what it confirms; ``False``: no draft was worth a call (decode as usual).

        Only while the request runs alone: onnxruntime's GroupQueryAttention takes several
        new tokens only in a batch of one (``batch_size must be 1 when sequence_length > 1``),
        so a request checking a draft beside others is a call of its own besides the batch's
        step, costing more than the batched step saves (measured on SmolLM2-135M int4: a
        step of 8 rows 20.8 ms, a 5-position call of one request 13.0 ms).

        The call's positions are sampled in order exactly as decode steps would sample
        them (grammar, penalties, stop strings, seeds), each from logits given the draft
        before it; the first token that differs from the draft ends the run in its place.
        Its rows are computed as a prompt's are, which round differently from a one-token
        step's: greedy tokens agree but for near-ties (see docs/performance.md).
        """
        drafter = request.drafter
        assert drafter is not None
        graph = self._graph
        length = request.length
        limit = min(MAX_DRAFT_TOKENS, request.max_tokens - len(request.tokens) - 1)
        window = graph.rope_window
        if window is not None and length <= window:
            limit = min(limit, window - length)  # the whole call within LongRoPE's window, as a step's
        draft = drafter.propose(request.tokens, limit)
        size = _draft_length(drafter.acceptance, len(draft))
        if not draft and self._draft is not None:  # no prediction to follow: the draft model's
            size = _draft_length(drafter.acceptance, limit, self._draft.cost)
            draft = self._draft.propose(request, size) if size else []
        if size == 0:
            if draft or self._draft is not None:
                drafter.skipped()
            return False
        draft = draft[:size]
        ids = np.asarray([[request.tokens[-1], *draft]], dtype=graph.ids_dtype)
        mask = np.ones((1, length + size), dtype=graph.mask_dtype)
        positions = np.arange(length - 1, length + size, dtype=graph.ids_dtype)[None, :]
        rows = slice(request.row, request.row + 1)
        logits = self._bind(rows, ids, mask, positions, request.adapter, every_position=True)
        events = []
        for position in range(size + 1):
            events.append(request.advance(logits[0, position]))
            if events[-1].finish_reason is not None or position == size or request.tokens[-1] != draft[position]:
                break
        accepted = sum(
            1 for token, drafted in zip(request.tokens[-len(events) :], draft, strict=False) if token == drafted
        )
        drafter.record(size, accepted)
        self.draft_tokens += size
        self.accepted_draft_tokens += accepted
        if events[-1].finish_reason is not None:
            self._release(request)
            # Its usage counts this call's drafts, accounted only now.
            events[-1] = dataclasses.replace(events[-1], usage=request.usage())
        for event in events:
            request.deliver(event)
        return True

    def _accept(self, request: Request, logits: npt.NDArray[np.float32]) -> None:
        """Sample the next token of ``request`` and tell its consumer."""
        event = request.advance(logits)
        if event.finish_reason is not None:
            self._release(request)
        request.deliver(event)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._release(request)
        request.deliver(request.final(reason))

    def _release(self, request: Request, *, keep: bool = True) -> None:
        """Free the request's row (``keep``: its key/values go to the prefix cache first);
        the last row moves into the hole so rows stay dense."""
        row = request.row
        if row < 0:
            return
        if keep:
            # Only the prompt's rows: the reply's were written by decode steps (see
            # _prefix_cache). Its prefill stored them already; this marks them recently used.
            self._remember(request)
            history = request.prompt + request.tokens
            if (
                request.tokens
                and not request.cancelled
                and self._graph.rope_window is None
                and len(history) <= self.prefix_cache.budget_tokens
            ):
                self._refills.append(_Refill(history, request.adapter, request.options.cache_salt))
        last = self._rows.pop()
        if last is not request:
            self._copy_row(last.row, row, last.length)
            self._rows[row] = last
            last.row = row
        request.row = -1
        pending = self._prefilling
        if pending is not None and pending.row != len(self._rows):
            # The prompt being prefilled sits right after the running rows: follow them down.
            self._copy_row(pending.row, len(self._rows), pending.prefilled)
            pending.row = len(self._rows)
        if last is not request:
            # The hole now holds ``last``: what the finished request wrote past that is stale.
            self._give_back_tokens(row, last.length, request.length)
        self._give_back_rows(len(self._rows) + (pending is not None))

    def _give_back_rows(self, first: int) -> None:
        """Return the memory of the rows from ``first`` on (no request holds them) to the
        operating system: a burst of requests leaves nothing behind once they are done."""
        if first >= self._rows_touched:
            return
        for arrays in self._cache:
            for array in arrays:
                row_bytes = array[0].nbytes
                _give_back(array, first * row_bytes, self._rows_touched * row_bytes)
        self._rows_touched = first

    def _give_back_tokens(self, row: int, start: int, end: int) -> None:
        """Return the memory of the tokens ``start`` to ``end`` of cache row ``row``."""
        for arrays in self._cache:
            for array in arrays:
                heads, length, head_size = array.shape[1:]
                token_bytes = head_size * array.itemsize
                for head in range(heads):
                    base = (row * heads + head) * length * token_bytes
                    _give_back(array, base + start * token_bytes, base + min(end, length) * token_bytes)

    def _regroup(self) -> None:
        """Order the rows by :meth:`_call_group` (LongRoPE's side of the window, then the
        adapter), so that a decode step makes one call per group rather than one per run.

        Rows arrive at the end, leave by the last row moving into the hole, and cross the
        window as they decode; each misplaced row is swapped into place once (copying both
        rows, a one-off cost against an extra call per step for the rest of both requests).
        """
        rows = self._rows
        for target, request in enumerate(sorted(rows, key=self._call_group)):
            if rows[target] is not request:
                self._swap_rows(target, request.row)

    def _swap_rows(self, first: int, second: int) -> None:
        rows = self._rows
        one, other = rows[first], rows[second]
        for keys, values in self._cache:
            for cache in (keys, values):
                held = cache[first, :, : one.length].copy()
                cache[first, :, : other.length] = cache[second, :, : other.length]
                cache[second, :, : one.length] = held
        rows[first], rows[second] = other, one
        other.row, one.row = first, second

    def _copy_row(self, source: int, target: int, length: int) -> None:
        for keys, values in self._cache:
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]


class _DraftModel:
    """A smaller model with the same tokenizer that drafts greedily for the request being
    checked (``speculative="draft:FOLDER"``; speculation runs for a request alone, so one
    cache row follows one request at a time: switching requests prefills the new one's
    sequence, and a rejected draft is dropped by keeping the row's common prefix with the
    sequence). Greedy drafts put all their weight on one guess, so checking them as
    :meth:`OrtCpuEngine._speculate` does keeps a sampled request's distribution."""

    def __init__(self, target: GenaiFolder, config: ModelConfig, max_sequence_length: int) -> None:
        path = config.draft_folder
        assert path is not None
        try:
            folder = GenaiFolder.read(path)
            same = folder.tokenizer_path.read_bytes() == target.tokenizer_path.read_bytes()
        except (ModelLoadError, OSError) as exc:
            raise ModelLoadError(f"speculative draft model {path}: {exc}", path=path) from exc
        if not same or folder.model.get("vocab_size") != target.model.get("vocab_size"):
            raise ModelLoadError(
                f"speculative draft model {path} has another tokenizer than {target.path} (tokenizer.json and "
                "vocab_size must match): its tokens would be another model's",
                path=path,
            )
        self.graph = _DecoderGraph(folder.path, folder.genai, dataclasses.replace(config, speculative=None))
        shapes = [(1, heads, max_sequence_length, size) for heads, size in self.graph.layer_shapes]
        dtype = self.graph.cache_dtype
        self._cache = [(_unhuged_zeros(shape, dtype), _unhuged_zeros(shape, dtype)) for shape in shapes]
        self._binding = self.graph.session.io_binding()
        self.graph.bind_cache(self._binding, self._cache, slice(0, 1))
        self._chunk = config.prefill_chunk_tokens
        self.cost = _weight_bytes(folder.path) / max(_weight_bytes(target.path), 1)
        """A draft token's cost in the target's decode steps, by their weights' sizes."""
        self._owner: Request | None = None
        self._cached: list[int] = []
        """The tokens whose key/values the row holds."""

    def propose(self, request: Request, size: int) -> list[int]:
        """``size`` greedy tokens to follow ``request``'s sequence."""
        sequence = [*request.prompt, *request.tokens]
        if self._owner is not request:
            self._owner, self._cached = request, []
        common = 0
        for cached, token in zip(self._cached, sequence, strict=False):
            if cached != token:
                break
            common += 1
        common = min(common, len(sequence) - 1)  # the last token goes in: its logits draft
        for start in range(common, len(sequence), self._chunk):
            logits = self._run(sequence[start : start + self._chunk], start)
        drafts = [int(np.argmax(logits))]
        while len(drafts) < size:
            drafts.append(int(np.argmax(self._run(drafts[-1:], len(sequence) + len(drafts) - 1))))
        self._cached = sequence + drafts[:-1]
        return drafts

    def _run(self, ids: list[int], start: int) -> npt.NDArray[np.float32]:
        graph, binding = self.graph, self._binding
        end = start + len(ids)
        binding.bind_cpu_input(graph.input_ids, np.asarray([ids], dtype=graph.ids_dtype))
        binding.bind_cpu_input(graph.attention_mask, np.ones((1, end), dtype=graph.mask_dtype))
        if graph.has_position_ids:
            binding.bind_cpu_input(graph.position_ids, np.arange(start, end, dtype=graph.ids_dtype)[None, :])
        if graph.last_only:
            binding.bind_cpu_input(LOGIT_POSITIONS, _LAST_POSITION)
        binding.bind_output(graph.logits)
        graph.session.run_with_iobinding(binding)
        logits: npt.NDArray[np.float32] = binding.get_outputs()[-1].numpy()[0, -1]
        return logits


_BACKGROUND_CHUNK = 32
"""Prompt tokens a background request prefills per call: an interactive request arriving
meanwhile waits for one such call, not a whole prompt."""


def _weight_bytes(folder: Path) -> int:
    """The size of a model folder's ONNX files and their external data."""
    return sum(path.stat().st_size for path in folder.iterdir() if ".onnx" in path.name)


def _draft_length(acceptance: float, available: int, draft_cost: float = 0.0) -> int:
    """The draft length (up to ``available``; 0: none) that yields the most tokens a second
    if each draft token is accepted with chance ``acceptance`` given the ones before it
    were: a call checking ``k`` drafts yields ``1 + a + ... + a**k`` tokens and costs
    ``1.1 + 0.2 (k - 1)`` decode steps (measured at 300 tokens of context: SmolLM2-135M
    int4 2.0x for 4 drafts and 2.75x for 8; the 0.5B-shaped model 1.10x, 1.66x and 2.6x
    for 1, 4 and 8).

    A draft model adds ``draft_cost`` decode steps per draft token. A fixed model, not
    timings: a request's drafts, and so the calls its tokens are computed in, then depend on
    the request alone (see :meth:`OrtCpuEngine._speculate`).
    """
    best, best_rate = 0, 1.0
    expected = 1.0
    for size in range(1, available + 1):
        expected += acceptance**size
        rate = expected / (1.1 + 0.2 * (size - 1) + draft_cost * size)
        if rate > best_rate:
            best, best_rate = size, rate
    return best


@dataclasses.dataclass(eq=False)
class _Refill:
    """A finished request's prompt and reply, prefilled for the prefix cache while the
    engine is idle (see :meth:`OrtCpuEngine._refill_step`); what the prefill path reads
    of a :class:`Request`."""

    prompt: list[int]
    adapter: str | None
    cache_salt: str | None = None
    row: int = -1
    prefilled: int = 0
    cached_tokens: int = 0


_REFILLS = 8
"""Finished requests waiting for a refill; older ones are dropped."""
_REFILL_CHUNK = 32
"""Tokens per refill call: what a request arriving during a refill may wait for (about
0.1 s on the 0.5B-shaped model)."""


def _even_call(start: int, end: int, length: int) -> tuple[int, int]:
    """The prompt positions a prefill call computes for the chunk ``start:end`` of a
    ``length``-token prompt: the chunk itself, or one token more, so that the call has an
    even number of rows (a one-token prompt aside).

    Why: onnxruntime's GroupQueryAttention takes the query rows of a call in blocks (32 rows
    on the tiny fixtures, 256 on SmolLM2-135M, measured with onnxruntime 1.31), and a block of
    one row goes through its one-row path, whose sums round differently. A row's key/values
    and logits then depend on where the call boundaries fell: a prompt's last token came
    out differently cold (in a 476-row call) and after a full prefix-cache hit (recomputed
    alone). Every other row is computed the same whatever call it is in (measured: every
    split, chunk size and suffix length), so calls of an even number of rows (no block of
    one, blocks being of an even size) make a prompt's rows a function of its tokens alone.
    A chunk after the first starts one token early, recomputing a row the cache already
    holds (the same values again); a first chunk takes one token more, or, when it is the
    whole prompt, one less (the next call then recomputes it with its neighbour).
    """
    if (end - start) % 2 == 0 or length < 2:
        return start, end
    if start > 0:
        return start - 1, end
    return start, end + 1 if end < length else end - 1


def _adapter_inputs(adapters: Mapping[str, Path]) -> dict[str, dict[str, ort.OrtValue]]:
    """Per adapter name, its tensors by the decoder input they feed (read once, with
    onnxruntime's ``AdapterFormat``; the values keep the file's memory alive).

    Bound as inputs rather than activated in ``RunOptions.add_active_adapter``: onnxruntime
    ignores active adapters in ``run_with_iobinding`` (it warns so), and the cache needs
    the binding. An input left unbound takes its default, which gives the base model.
    """
    return {name: dict(ort.AdapterFormat.read_adapter(str(path)).get_parameters()) for name, path in adapters.items()}


_PAGE = mmap.PAGESIZE
_INT8_PREFILL_MIN_TOKENS = 64
"""Prompt chunks this long or longer go through the int8 prefill session when there is one."""
_SHRINK_AFTER_TOKENS = 128
"""Calls of a prompt chunk this long or longer return the memory they took from the arena
(decode steps, one token a row, keep theirs however many rows they have)."""


def _release_freed_memory() -> None:
    """Hand memory the C allocator holds free back to the system (glibc's ``malloc_trim``;
    elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _unhuged_zeros(shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
    """Zeros in an anonymous memory map, taken from the system a page at a time as written.

    numpy asks for transparent huge pages on large arrays, so the first token written to a
    cache row made 2 MB of it resident per layer (measured: a burst of 16 short requests
    held 1.6 GB); and a map's pages can be given back (:func:`_give_back`).
    """
    count = int(np.prod(shape))
    buffer = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(buffer, dtype, count).reshape(shape)


def _give_back(array: npt.NDArray[Any], start: int, end: int) -> None:
    """Drop the whole pages of bytes ``start`` to ``end`` of an :func:`_unhuged_zeros`
    array: they read as zeros again and cost no memory until written."""
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    buffer: Any = array
    while isinstance(buffer, np.ndarray):
        buffer = buffer.base
    buffer = buffer.obj if isinstance(buffer, memoryview) else buffer
    if last > first and isinstance(buffer, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        buffer.madvise(mmap.MADV_DONTNEED, first, last - first)


def _longrope_window(graph: onnx.GraphProto, attention_mask: str, model_path: Path) -> int | None:
    """The window of a LongRoPE graph, or ``None`` for a graph without one.

    The genai builder (``make_rotary_embedding_multi_cache``, CPU and CUDA builds) writes
    ``If(Greater(Shape(attention_mask)[1], original_max_position_embeddings))`` choosing
    between constant cos/sin caches made with the long factors (then) and the short ones
    (else). Nothing in genai_config.json says so. A selection by anything else is refused
    rather than guessed: this engine could not reproduce og's factors.
    """
    producers = {output: node for node in graph.node for output in node.output}
    constants = {tensor.name: tensor for tensor in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    for node in graph.node:
        if node.op_type != "If" or not any("cos_cache" in output for output in node.output):
            continue
        greater = producers.get(node.input[0])
        gather = producers.get(greater.input[0]) if greater is not None and greater.op_type == "Greater" else None
        shape = producers.get(gather.input[0]) if gather is not None and gather.op_type == "Gather" else None
        if (
            greater is not None
            and gather is not None
            and shape is not None
            and shape.op_type == "Shape"
            and shape.input[0] == attention_mask
            and gather.input[1] in constants
            and int(onnx.numpy_helper.to_array(constants[gather.input[1]])) == 1
            and greater.input[1] in constants
        ):
            return int(onnx.numpy_helper.to_array(constants[greater.input[1]]))
        raise NotDrivableError(
            f"{model_path} chooses its rotary caches by a rule the ort-cpu engine does not know "
            f"({node.name}); use --engine og-generator",
            path=model_path,
        )
    return None


def _open_session(
    model_path: Path, graph_model: onnx.ModelProto, options: ort.SessionOptions, logits: str, *, last_only: bool
) -> tuple[ort.InferenceSession, bool]:
    """An onnxruntime session for the decoder computing logits of the last position only,
    and whether it does (``last_only`` off, or a graph of another shape: every position).

    Sampling needs only the last position's logits, yet the builder's graphs project every
    prompt position through the vocabulary-sized LM head (a quarter of the prefill work
    for a 0.5B model, measured). A Gather of the last position in front of the node that
    writes the logits removes that work; decode steps (one position) are unchanged.
    """
    graph = graph_model.graph
    producers = [node for node in graph.node if logits in node.output]
    outputs = [o for o in graph.output if o.name == logits]
    if last_only and len(producers) == 1 and len(outputs) == 1 and len(outputs[0].type.tensor_type.shape.dim) == 3:
        head = producers[0]
        hidden_name = LOGIT_POSITIONS + "_hidden"
        # An input, bound by every call: the last position, or every position a speculative
        # check ran. (Not an initializer overridden: an IO binding cannot bind one.)
        graph.input.append(onnx.helper.make_tensor_value_info(LOGIT_POSITIONS, onnx.TensorProto.INT64, ["positions"]))
        gather = onnx.helper.make_node(
            "Gather", [head.input[0], LOGIT_POSITIONS], [hidden_name], axis=1, name=hidden_name
        )
        head.input[0] = hidden_name
        graph.node.insert(list(graph.node).index(head), gather)
        outputs[0].type.tensor_type.shape.dim[1].dim_param = "positions"
    else:
        last_only = False
    return _session_from_graph(model_path, graph_model, options), last_only


LOGIT_POSITIONS = "ortserve/logit_positions"
"""The decoder input (added by :func:`_open_session`) choosing the positions whose logits
are computed; the last one by default."""

_LAST_POSITION = np.array([-1], dtype=np.int64)

_EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def _session_from_graph(model_path: Path, graph_model: onnx.ModelProto, options: ort.SessionOptions) -> Any:
    """A CPU session for ``graph_model`` (edited in memory) whose weights stay in the
    external data files beside ``model_path``.

    Where the files resolve into one folder (the Hugging Face cache links them to its
    blobs), onnxruntime maps them itself from there: weights it does not repack are then
    read from the page cache, not copied (measured: 141 MB less resident on the 0.5B-shaped
    model). Otherwise, or with an onnxruntime without that option, they are handed over as
    memory maps, which onnxruntime copies.
    """
    providers = ["CPUExecutionProvider"]
    entries = [
        entry
        for tensor in graph_model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    ]
    # Resolved once per file, not per tensor (516 tensors on SmolLM2: 40 ms of a 0.5 s load).
    files = {location: (model_path.parent / location).resolve() for location in {entry.value for entry in entries}}
    folders = {file.parent for file in files.values()}
    if len(folders) == 1:
        for entry in entries:
            entry.value = files[entry.value].name
        files = {file.name: file for file in files.values()}
        options.add_session_config_entry(_EXTERNAL_FOLDER, str(folders.pop()))
        with contextlib.suppress(ort.capi.onnxruntime_pybind11_state.Fail):  # no such option: the maps below
            return ort.InferenceSession(graph_model.SerializeToString(), options, providers=providers)
    with contextlib.ExitStack() as stack:
        maps = []
        for file in files.values():
            handle = stack.enter_context(file.open("rb"))
            maps.append(stack.enter_context(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)))
        if maps:
            options.add_external_initializers_from_files_in_memory(list(files), maps, [len(m) for m in maps])
        return ort.InferenceSession(graph_model.SerializeToString(), options, providers=providers)


@functools.cache
def _lone_row_rounds_differently() -> bool:
    """Whether onnxruntime's int4 MatMul (``MatMulNBits``) gives a row alone other bits than
    the same row among several. On an AVX2-only EPYC it does (another kernel for one row:
    SmolLM2-135M's logprobs moved up to 1.39 beside 7 other requests against alone); with
    AVX-512 it did not. Measured once per process on a small product."""
    rng = np.random.default_rng(0)
    k, n, block = 64, 32, 32
    packed = rng.integers(0, 256, size=(n, k // block, block // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=(n * (k // block),)).astype(np.float32)
    node = onnx.helper.make_node(
        "MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block
    )
    graph = onnx.helper.make_graph(
        [node],
        "probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["M", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["M", n])],
        [onnx.numpy_helper.from_array(packed, "w"), onnx.numpy_helper.from_array(scales, "s")],
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((4, k)).astype(np.float32)
    return not np.array_equal(session.run(None, {"x": x[:1]})[0][0], session.run(None, {"x": x})[0][0])
