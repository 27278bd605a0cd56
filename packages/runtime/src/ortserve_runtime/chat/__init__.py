"""The front of generative models: chat template, tools, grammars, validation, prompts."""

from .._contract import FinishReason, GenerationEvent, Request, Usage
from ._constraints import Grammar
from ._logprobs import PromptLogprobs, TokenBytes, TokenLogprob, TopLogprob
from ._media import AudioInput, ImageInput
from ._model import ChatModel
from ._multimodal import MULTIMODAL_TYPES, MediaProcessor, media_of
from ._reasoning import ReasoningMarkers, ReasoningParser, ReasoningStart, detect_reasoning
from ._sampling import GenerationOptions
from ._stream import GenerationStream, Prompt
from ._template import ChatTemplate, Message
from ._tools import ToolCall, ToolCallFormat, ToolCallParser, detect_tool_format, forced_tool_grammar

__all__ = [
    "MULTIMODAL_TYPES",
    "AudioInput",
    "ChatModel",
    "ChatTemplate",
    "FinishReason",
    "GenerationEvent",
    "GenerationOptions",
    "GenerationStream",
    "Grammar",
    "ImageInput",
    "MediaProcessor",
    "Message",
    "Prompt",
    "PromptLogprobs",
    "ReasoningMarkers",
    "ReasoningParser",
    "ReasoningStart",
    "Request",
    "TokenBytes",
    "TokenLogprob",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallParser",
    "TopLogprob",
    "Usage",
    "detect_reasoning",
    "detect_tool_format",
    "forced_tool_grammar",
    "media_of",
]
