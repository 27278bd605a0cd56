"""Errors of the runtime.

```
EngineError                 root: anything the runtime raises on purpose; itself: onnxruntime failed one request
├── ModelLoadError          a folder that is missing, not a model, or corrupt (has .path)
├── ModelNotFoundError      a name the registry does not know (has .name)
│   └── AdapterNotFoundError  a LoRA adapter the model was not loaded with (has .adapter)
├── ModelCapacityError      no room to load a model: limits reached and every loaded model busy (has .name)
├── InvalidRequestError     bad input caught before it reaches onnxruntime (has .param)
│   └── ContextLengthError  prompt (plus max_tokens) longer than the model's context
├── EngineClosedError       the model was unloaded or closed while a request waited
├── ModelCrashedError       the process the model ran in ended
└── PreemptedError          a background request gave its batch row to an interactive one
```

The server maps these onto HTTP statuses; nothing here knows about HTTP.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "AdapterNotFoundError",
    "ContextLengthError",
    "EngineClosedError",
    "EngineError",
    "InvalidRequestError",
    "ModelCapacityError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PreemptedError",
]


class EngineError(Exception):
    """Root of every error the runtime raises on purpose."""


class ModelLoadError(EngineError):
    """A model folder could not be loaded; the message names the path."""

    def __init__(self, message: str, *, path: Path | str) -> None:
        super().__init__(message)
        self.path = Path(path)


class ModelNotFoundError(EngineError):
    """The registry has no model of that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model {name!r} does not exist")
        self.name = name


class AdapterNotFoundError(ModelNotFoundError):
    """A request named a LoRA adapter its model was not loaded with."""

    def __init__(self, model: str, adapter: str, adapters: tuple[str, ...]) -> None:
        super().__init__(f"{model}:{adapter}")
        if adapters:
            known = f"its adapters are {', '.join(repr(a) for a in adapters)}"
        else:
            known = f"it has none (serve one with --adapter {model}:{adapter}=PATH)"
        self.args = (f"model {model!r} has no LoRA adapter {adapter!r}: {known}",)
        self.model = model
        self.adapter = adapter


class ModelCapacityError(EngineError):
    """Loading the model would pass the registry's model count or memory budget, and no
    loaded model is idle to make room; worth retrying once requests finish."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


class InvalidRequestError(EngineError):
    """Input rejected before it reaches the engine; ``param`` names the field at fault."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt, or prompt plus requested tokens, does not fit the model's context."""


class ModelCrashedError(EngineError):
    """The process the model ran in ended (a crash inside onnxruntime-genai): its requests
    fail with this, and the next request loads the model again."""


class EngineClosedError(EngineError):
    """The model was closed (unloaded or shutting down) before the request finished."""


class PreemptedError(EngineError):
    """A background request (``GenerationOptions.background``, a batch's line) gave up its
    batch row to an interactive request that was waiting; nothing of it was delivered
    beyond what came before, and it can run again."""
