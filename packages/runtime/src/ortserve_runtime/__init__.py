"""ortserve-runtime: ONNX Runtime GenAI inference with batching, streaming and cancellation.

No HTTP here: plain Python types in, async event streams and NumPy arrays out.
"""

import importlib.util as _importlib_util

# The onnxruntime wheels are extras (one per accelerator; they cannot share an environment),
# so an install without one fails here, saying what to add, not deep in an import chain.
_missing = [name for name in ("onnxruntime", "onnxruntime_genai") if _importlib_util.find_spec(name) is None]
if _missing:
    raise ImportError(
        f"ortserve-runtime needs {' and '.join(_missing)}: install it with exactly one extra, "
        '"ortserve-runtime[cpu]", "[cuda]", "[directml]" or "[openvino]"'
    )

from ._config import EmbeddingConfig, EngineName, KvCacheDtype, ModelConfig, RerankConfig
from ._contract import Engine, EngineCapabilities
from ._errors import (
    AdapterNotFoundError,
    ContextLengthError,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    ModelCapacityError,
    ModelCrashedError,
    ModelLoadError,
    ModelNotFoundError,
    PreemptedError,
)
from ._loading import ModelKind, detect_model_kind, load_chat_model, media_inputs, pick_engine
from ._providers import PROVIDERS, Provider
from ._registry import ModelLease, ModelRegistry, ModelState, ModelStatus
from .chat import (
    AudioInput,
    ChatModel,
    ChatTemplate,
    FinishReason,
    GenerationEvent,
    GenerationOptions,
    GenerationStream,
    Grammar,
    ImageInput,
    Message,
    Prompt,
    PromptLogprobs,
    ReasoningMarkers,
    ReasoningParser,
    ReasoningStart,
    TokenLogprob,
    ToolCall,
    ToolCallFormat,
    ToolCallParser,
    TopLogprob,
    Usage,
    detect_tool_format,
    forced_tool_grammar,
)
from .embeddings import EmbeddingInput, EmbeddingModel, EmbeddingResult, Pooling, RerankModel, RerankResult
from .speech import Segment, SpeechChunk, SpeechModel, Transcription, VoiceModel

__all__ = [
    "PROVIDERS",
    "AdapterNotFoundError",
    "AudioInput",
    "ChatModel",
    "ChatTemplate",
    "ContextLengthError",
    "EmbeddingConfig",
    "EmbeddingInput",
    "EmbeddingModel",
    "EmbeddingResult",
    "Engine",
    "EngineCapabilities",
    "EngineClosedError",
    "EngineError",
    "EngineName",
    "FinishReason",
    "GenerationEvent",
    "GenerationOptions",
    "GenerationStream",
    "Grammar",
    "ImageInput",
    "InvalidRequestError",
    "KvCacheDtype",
    "Message",
    "ModelCapacityError",
    "ModelConfig",
    "ModelCrashedError",
    "ModelKind",
    "ModelLease",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelRegistry",
    "ModelState",
    "ModelStatus",
    "Pooling",
    "PreemptedError",
    "Prompt",
    "PromptLogprobs",
    "Provider",
    "ReasoningMarkers",
    "ReasoningParser",
    "ReasoningStart",
    "RerankConfig",
    "RerankModel",
    "RerankResult",
    "Segment",
    "SpeechChunk",
    "SpeechModel",
    "TokenLogprob",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallParser",
    "TopLogprob",
    "Transcription",
    "Usage",
    "VoiceModel",
    "detect_model_kind",
    "detect_tool_format",
    "forced_tool_grammar",
    "load_chat_model",
    "media_inputs",
    "pick_engine",
]
