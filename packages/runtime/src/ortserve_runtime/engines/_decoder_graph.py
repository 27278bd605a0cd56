"""The decoder graph the ort-cpu engine drives, read and opened once per load.

:class:`DecoderGraph` reads the genai builder's decoder ONNX graph with the names
genai_config.json gives its inputs and outputs, refuses what the engine does not feed
(:class:`NotDrivableError`: og's engines may run it), stores its key/value cache in the
configured type, and opens onnxruntime sessions on it: the decoder itself, with an input
that picks the positions whose logits are computed (:data:`LOGIT_POSITIONS`), and its int8
prefill copy.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnxruntime as ort
from tokenizers import Tokenizer

from .._config import ModelConfig
from .._errors import ModelLoadError
from .._model_files import MAX_GRAPH_BYTES, checked_file
from ._int8_prefill import int8_cache, int8_prefill_folder
from ._kv_storage import CALIBRATION_TEXT, KvScales, load_or_measure_scales, scales_from_cache, store_kv_as

__all__ = ["LAST_POSITION", "LOGIT_POSITIONS", "DecoderGraph", "NotDrivableError", "open_session"]

logger = logging.getLogger(__name__)

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}


class NotDrivableError(ModelLoadError):
    """The folder's decoder needs what the ort-cpu engine does not feed (its message says
    what); og's engines may run it."""


class DecoderGraph:
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
        checked_file(model_path, MAX_GRAPH_BYTES)
        try:
            # Weights stay on disk: the graph alone says how the session is opened and
            # whether the model uses LongRoPE.
            graph_model = onnx.load(str(model_path), load_external_data=False)
        except Exception as exc:  # onnx raises its own untyped errors for corrupt files
            raise ModelLoadError(f"{model_path} could not be loaded by onnxruntime: {exc}", path=model_path) from exc
        self.model_path = model_path
        if not 0 < self.layers <= len(graph_model.graph.input):
            # Checked before any per-layer work: 1,000,000 layers made 4 million names and
            # sorted them, holding the GIL 4 s (fourteenth probe of the hardening issue).
            raise ModelLoadError(
                f"genai_config.json gives {self.layers:,} layers (model.decoder.num_hidden_layers); "
                f"{model_path} has {len(graph_model.graph.input)} inputs",
                path=model_path,
            )
        self.cache_names = [
            (past_key % i, present_key % i, past_value % i, present_value % i) for i in range(self.layers)
        ]
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
            self.session, self.last_only = open_session(
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
        session, last_only = open_session(self.model_path, unchanged, self._options(), self.logits, last_only=True)
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
            binding.bind_cpu_input(LOGIT_POSITIONS, LAST_POSITION)
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
        session, _ = open_session(folder / "model.onnx", graph_model, self._options(), self.logits, last_only=True)
        return session


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


def open_session(
    model_path: Path, graph_model: onnx.ModelProto, options: ort.SessionOptions, logits: str, *, last_only: bool
) -> tuple[ort.InferenceSession, bool]:
    """An onnxruntime session for the decoder computing logits of the last position only,
    and whether it does (``last_only`` off, or a graph of another shape: every position).

    Sampling needs only the last position's logits, yet the builder's graphs project every
    prompt position through the vocabulary-sized LM head (a quarter of the prefill work
    for a 0.5B model, measured). A Gather of the last position in front of the LM head
    (:func:`_logit_head`: behind a final softcap where there is one) removes that work;
    decode steps (one position) are unchanged.
    """
    graph = graph_model.graph
    producers = [node for node in graph.node if logits in node.output]
    outputs = [o for o in graph.output if o.name == logits]
    if last_only and len(producers) == 1 and len(outputs) == 1 and len(outputs[0].type.tensor_type.shape.dim) == 3:
        head = _logit_head(graph, producers[0])
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


_HEADS = frozenset({"MatMul", "MatMulNBits"})
_UNARY = frozenset({"Tanh", "Cast", "Identity"})
_WITH_CONSTANT = frozenset({"Mul", "Div", "Add", "Sub"})


def _logit_head(graph: onnx.GraphProto, writer: onnx.NodeProto) -> onnx.NodeProto:
    """The node to gather the positions in front of: the LM head's ``MatMul`` or
    ``MatMulNBits``, found from ``writer`` (the node writing the logits) back through a
    chain of elementwise nodes whose other inputs are constants (Gemma 2's final softcap:
    ``Mul``, ``Tanh``, ``Mul`` in a GGUF folder, ``Div``, ``Tanh``, ``Mul`` from og's
    builder; a ``Cast`` to float32), each the only reader of what it reads. Gathering there
    keeps the vocabulary-sized head (256k rows on Gemma 2) off every prompt position but
    the last, as the chain computes position by position. Where the chain ends elsewhere,
    ``writer`` itself: the gather in front of it is right, only not as early."""
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    constants = {tensor.name: list(tensor.dims) for tensor in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = list(node.attribute[0].t.dims)
    graph_outputs = {output.name for output in graph.output}
    node = writer
    while node.op_type in _UNARY or node.op_type in _WITH_CONSTANT:
        variable = [name for name in node.input if name not in constants]
        shapes = [constants[name] for name in node.input if name in constants]
        # A constant must broadcast over the vocabulary alone (a scalar, or a value per
        # token id), never along the positions that the gather removes.
        if len(variable) != 1 or any(d != 1 for shape in shapes for d in shape[:-1]):
            break
        source = producers.get(variable[0])
        if source is None or readers.get(variable[0]) != 1 or variable[0] in graph_outputs:
            break
        node = source
    return node if node.op_type in _HEADS else writer


LOGIT_POSITIONS = "ortserve/logit_positions"
"""The decoder input (added by :func:`open_session`) choosing the positions whose logits
are computed; the last one by default."""

LAST_POSITION = np.array([-1], dtype=np.int64)

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
