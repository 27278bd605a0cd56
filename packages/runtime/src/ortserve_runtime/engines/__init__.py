"""Engines: what runs a generative model's requests (the back; see :class:`Engine`)."""

from typing import TYPE_CHECKING, Any

from .._contract import Engine, EngineCapabilities
from ._og_generator import OgGeneratorEngine
from ._ort_cpu import NotDrivableError, OrtCpuEngine

if TYPE_CHECKING:
    from ._og_engine import OgEngine

__all__ = ["Engine", "EngineCapabilities", "NotDrivableError", "OgEngine", "OgGeneratorEngine", "OrtCpuEngine"]


def __getattr__(name: str) -> Any:
    # og-engine imports onnxruntime-genai itself (50-100 ms): only where a model runs on it.
    if name == "OgEngine":
        from ._og_engine import OgEngine

        return OgEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
