"""Loading: what a folder is, which engine runs it, and the model that a load makes.

:func:`detect_model_kind` reads a folder once to say what it holds; :func:`load_model`
builds the model of a kind (for generative folders, the front over the engine
:func:`pick_engine` chose) and :func:`measured_load` also measures what the load cost in
resident memory, which the registry's residency weighs against its budget.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from ._config import EngineName, ModelConfig
from ._contract import OwnerThread
from ._errors import ModelLoadError
from ._folder import GenaiFolder, check_og_runs, load_og_model
from ._memory import resident_memory
from ._model_files import read_json_file
from ._og_process import OgProcess
from .chat import MULTIMODAL_TYPES, ChatModel, MediaProcessor, media_of
from .embeddings import EmbeddingModel, RerankModel
from .engines import Engine, NotDrivableError, OgGeneratorEngine, OrtCpuEngine
from .engines._adapters import check_adapters
from .sources import source_kind
from .speech import SpeechModel, VoiceModel, find_voice_files

logger = logging.getLogger(__name__)

__all__ = [
    "Model",
    "ModelKind",
    "detect_model_kind",
    "load_chat_model",
    "load_model",
    "measured_load",
    "media_inputs",
    "pick_engine",
]

ModelKind = Literal["generative", "embedding", "rerank", "speech", "voice"]
Model = ChatModel | EmbeddingModel | RerankModel | SpeechModel | VoiceModel


def detect_model_kind(folder: Path) -> ModelKind:
    """Recognise a model folder, or raise :class:`ModelLoadError` naming the path."""
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist", path=folder)
    if source_kind(folder) is not None:
        return "generative"  # a GGUF file or a checkpoint: made into a genai folder when it loads
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is neither a model folder nor a GGUF file (.gguf)", path=folder)
    config_path = folder / "genai_config.json"
    if config_path.exists():
        try:  # bounded: every --model's kind is read at start, --lazy or not
            model_type = read_json_file(config_path).get("model", {}).get("type")
        except (ModelLoadError, AttributeError):
            return "generative"  # loading it reports what is wrong, naming the file
        return "speech" if model_type == "whisper" else "generative"
    has_onnx = (folder / "model.onnx").exists() or (folder / "onnx" / "model.onnx").exists()
    if has_onnx and ((folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()):
        return "rerank" if _is_sequence_classifier(folder) else "embedding"
    if find_voice_files(folder) is not None:
        return "voice"
    raise ModelLoadError(
        f"{folder} is not a model folder: expected a GGUF file, genai_config.json (generative or speech model), "
        "a transformers checkpoint (config.json of a *ForCausalLM with safetensors), "
        "an ONNX encoder with tokenizer.json (embedding model; a *ForSequenceClassification "
        "config.json makes it a rerank model) or a Piper voice (x.onnx with x.onnx.json)",
        path=folder,
    )


def media_inputs(folder: Path) -> frozenset[str]:
    """What a model folder takes in its chats besides text (``image``, ``audio``; nothing for
    a text model, or a folder that cannot be read), as :class:`~.chat.MediaProcessor` serves it."""
    config_path = folder / "genai_config.json"
    try:
        model = read_json_file(config_path).get("model", {}) if config_path.is_file() else {}
    except (ModelLoadError, AttributeError):
        return frozenset()
    return media_of(model) if isinstance(model, dict) else frozenset()


def _is_sequence_classifier(folder: Path) -> bool:
    """config.json's architectures name a ``*ForSequenceClassification`` (a cross-encoder)."""
    try:
        architectures = read_json_file(folder / "config.json").get("architectures")
    except (ModelLoadError, AttributeError):
        return False  # no config.json, or not one of transformers': an embedding model
    return isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures
    )


def pick_engine(folder: GenaiFolder, config: ModelConfig) -> EngineName:
    """The engine for ``folder`` on ``config.provider`` (``config.engine`` unless ``auto``).

    auto: multimodal folders run on og-generator (og.Engine takes decoder-only models);
    text on the CPU provider on ort-cpu (continuous batching, measured faster than og
    there); text on another provider on og-engine where the folder was built for paged
    attention (dynamic batching), else og-generator (og.Engine's static batches make a
    newcomer wait for a whole batch to finish). With LoRA adapters, og-generator there too:
    og.Engine takes no adapter per request. A text folder the ort-cpu engine finds it cannot
    drive when it loads (see :class:`NotDrivableError`) falls back to og-generator then.
    """
    return _pick_engine(folder, config)[0]


def _pick_engine(folder: GenaiFolder, config: ModelConfig) -> tuple[EngineName, str]:
    """:func:`pick_engine`'s choice and why (the model status's ``engine_reason``)."""
    if config.engine != "auto":
        return config.engine, f"engine {config.engine} was asked for"
    if folder.model_type in MULTIMODAL_TYPES:
        return "og-generator", f"auto: a multimodal model ({folder.model_type}) runs on og-generator"
    if config.provider == "cpu":
        return "ort-cpu", "auto: a text model on the CPU runs on ort-cpu (continuous batching)"
    if folder.paged_attention and not config.adapters:
        return "og-engine", f"auto: built for paged attention on {config.provider} (og.Engine's dynamic batching)"
    why = "LoRA adapters (og.Engine takes none per request)" if config.adapters else "no paged attention"
    return "og-generator", f"auto: {why} on {config.provider}"


def _check_folder(path: Path, folder: GenaiFolder, config: ModelConfig, choice: EngineName) -> None:
    """Refuse, by name, a folder that ``choice`` on ``config.provider`` cannot serve."""
    multimodal = folder.model_type in MULTIMODAL_TYPES
    if folder.paged_attention and config.provider == "cpu":
        # onnxruntime's CPU provider has no PagedAttention kernel: og's own error names a cast.
        raise ModelLoadError(
            f"{path} was built with paged attention (og.Engine's dynamic batches on CUDA or WebGPU), which the "
            "CPU cannot run; serve it with --provider cuda, or use a folder built without use_paged_attention",
            path=path,
        )
    if folder.paged_attention and choice != "og-engine":
        # Its decoder takes one packed token axis and block tables, which only og.Engine feeds.
        raise ModelLoadError(
            f"{path} was built with paged attention, which only the og-engine engine runs (not {choice}); "
            "use --engine og-engine or auto",
            path=path,
        )
    if multimodal and choice != "og-generator":
        raise ModelLoadError(
            f"{path} is a multimodal model ({folder.model_type}); it runs on the og-generator engine only, "
            f"not {choice}",
            path=path,
        )


def load_chat_model(name: str, path: Path, config: ModelConfig) -> ChatModel:
    """A generative model: the front (:class:`ChatModel`) over the engine :func:`pick_engine` chose."""
    folder = GenaiFolder.read(path)
    multimodal = folder.model_type in MULTIMODAL_TYPES
    choice, reason = _pick_engine(folder, config)
    folder.tokenizer_path  # noqa: B018  # a missing tokenizer is named before an engine loads
    folder.check_graph_files()
    if (folder.is_multimodal and not multimodal) or folder.is_encoder_decoder:
        raise ModelLoadError(
            f"{path} is a multimodal or encoder-decoder model ({folder.model_type}); the multimodal types served "
            f"are {sorted(MULTIMODAL_TYPES)}, and decoder-only text models",
            path=path,
        )
    _check_folder(path, folder, config, choice)
    if config.adapters and choice == "og-engine":
        raise ModelLoadError(
            f"{path}: the og-engine engine cannot serve LoRA adapters (onnxruntime-genai's og.Engine takes no "
            "adapter per request); use --engine og-generator or auto",
            path=path,
        )
    if choice != "ort-cpu":
        _check_ort_cpu_settings(path, config, choice)
    adapters = check_adapters(folder, config.adapters)
    engine: Engine | None = None
    media = None
    refusal = None
    """Why ort-cpu refused the folder, when auto falls back to og-generator."""
    if choice == "ort-cpu":
        try:
            engine = OrtCpuEngine(name, folder, config, folder.max_sequence_length(config), adapters)
        except NotDrivableError as exc:
            if config.engine != "auto" or _asks_for_ort_cpu(config):
                raise
            refusal = str(exc)
            choice, reason = "og-generator", f"auto: {refusal}; og-generator runs it"
            logger.info("model %r: %s", name, reason)
    if engine is None:
        _check_og_speculation(folder, config, choice, refusal)
        speculative = config.speculative is not None
        if choice == "og-engine":  # og.Engine.run releases the GIL: it stays in this process
            from .engines import OgEngine

            og_model = load_og_model(path, config)
            if not folder.paged_attention:  # og.Generator cannot drive it: OgEngine runs its own check
                _checked_og(
                    lambda: check_og_runs(og_model, folder, config.provider, speculative=speculative), refusal, path
                )
            engine = OgEngine(
                name,
                og_model,
                config,
                folder=path,
                dynamic=folder.paged_attention,
                shortest_sequence=folder.shortest_sequence,
            )
        else:
            og = OgProcess(path, config)
            try:
                if not multimodal:
                    _checked_og(lambda: og.call("step", "check_runs", speculative), refusal, path)
                media = MediaProcessor(folder, og, config) if multimodal else None
                engine = OgGeneratorEngine(
                    name,
                    og,
                    config,
                    concurrency=config.multimodal_concurrency if multimodal else config.max_batch_size,
                    shortest_sequence=folder.shortest_sequence,
                    adapters=adapters,
                )
            except BaseException:
                og.close()
                raise
    try:
        model = ChatModel(name, folder, config, engine, media)
    except BaseException:
        if isinstance(engine, OwnerThread):
            engine.shutdown()
        raise
    model.engine_reason = reason
    return model


def _checked_og(check: Callable[[], None], refusal: str | None, path: Path) -> None:
    """``check`` (og runs the folder), its failure also naming why ort-cpu refused it
    when ``auto`` fell back to og."""
    try:
        check()
    except ModelLoadError as exc:
        if refusal is None:
            raise
        raise ModelLoadError(f"no engine runs it: {refusal}; {exc}", path=path) from exc


def _asks_for_ort_cpu(config: ModelConfig) -> bool:
    """Whether ``config`` sets what only the ort-cpu engine reads (``auto`` then does not
    fall back to og for a model ort-cpu cannot drive: the setting would go unread)."""
    return bool(config.prefill_int8) or config.prefix_cache_mb is not None or config.kv_cache_dtype != "auto"


def _check_ort_cpu_settings(path: Path, config: ModelConfig, choice: str) -> None:
    """Refuse, naming them, the settings only the ort-cpu engine reads, for a model that
    runs on ``choice`` (an og engine)."""
    if config.prefix_cache_mb is not None:
        raise ModelLoadError(
            f"{path}: prefix_cache_mb (--prefix-cache-mb) sizes the ort-cpu engine's prefix cache, and this model "
            f"runs on {choice}, which keeps none of ortserve's; set it per model for ort-cpu models "
            "(--model-option NAME:prefix-cache-mb=MIB)",
            path=path,
        )
    if config.kv_cache_dtype != "auto":
        raise ModelLoadError(
            f"{path}: kv_cache_dtype={config.kv_cache_dtype} (--kv-cache-dtype) applies to the ort-cpu engine's "
            f"key/value cache, and this model runs on {choice}, which keeps its own; set it per model for ort-cpu "
            "models (--model-option NAME:kv-cache-dtype=fp16)",
            path=path,
        )
    if config.prefill_int8:
        raise ModelLoadError(
            f"{path}: prefill_int8 (--prefill-int8 on) applies to the ort-cpu engine only, and this model runs on "
            f"{choice}; turn it off for this model (--model-option NAME:prefill-int8=off)",
            path=path,
        )


def _check_og_speculation(folder: GenaiFolder, config: ModelConfig, choice: str, refusal: str | None) -> None:
    """Refuse ``speculative`` where onnxruntime-genai cannot do it (measured with og 0.18,
    its errors quoted): og.Engine takes no n-gram option, and og.Generator's n-gram decoding
    "requires a plain decoder-only text model" (multimodal models; others are probed by
    :func:`check_og_runs`) and "cannot rewind" a sliding-window cache once it is full."""
    decoder = folder.genai.get("model", {}).get("decoder", {})
    if config.speculative is None:
        return
    if config.draft_folder is not None:
        why = "draft models (draft:FOLDER) run on ort-cpu only"
    elif choice == "og-engine":
        why = "og.Engine takes no n-gram speculation (only drafts a caller gives, on paged attention)"
    elif folder.is_multimodal or refusal is not None:
        why = "onnxruntime-genai's n-gram decoding requires a plain decoder-only text model" + (
            f" ({refusal})" if refusal else ""
        )
    elif isinstance(decoder.get("sliding_window"), dict):
        why = "onnxruntime-genai cannot rewind its sliding-window cache after a rejected draft"
    else:
        return
    raise ModelLoadError(
        f"{folder.path}: speculative ({config.speculative}) on the {choice} engine: {why}; serve this model with "
        "--model-option NAME:speculative=off, or on ort-cpu",
        path=folder.path,
    )


def load_model(kind: ModelKind, name: str, path: Path, config: ModelConfig) -> Model:
    """The model of ``kind`` called ``name`` from the folder ``path``, loaded now (blocks)."""
    factories: dict[ModelKind, Callable[[str, Path, ModelConfig], Model]] = {
        "generative": load_chat_model,
        "embedding": EmbeddingModel,
        "rerank": RerankModel,
        "speech": SpeechModel,
        "voice": VoiceModel,
    }
    return factories[kind](name, path, config)


def measured_load(kind: ModelKind, name: str, path: Path, config: ModelConfig) -> tuple[Model, int]:
    """:func:`load_model`, and the growth of the resident set around the load (plus the
    resident set of a process the model runs in).

    Garbage is collected first: objects of an earlier model freed during this load made
    the growth read 0 (seen in a test process that had served other models). Not while the
    collector is off (``ortserve serve``'s start-up): then none runs during the load, and
    the pass over the start-up's objects took 33 ms of the GIL."""
    if gc.isenabled():
        gc.collect()
    before = resident_memory()
    model = load_model(kind, name, path, config)
    elsewhere = getattr(model, "process_resident_bytes", 0)  # og's own process
    return model, max(0, resident_memory() - before) + elsewhere
