"""Engines: what runs a generative model's requests (the back; see :class:`Engine`)."""

from .._contract import Engine, EngineCapabilities
from ._og_engine import OgEngine
from ._og_generator import OgGeneratorEngine
from ._ort_cpu import NotDrivableError, OrtCpuEngine

__all__ = ["Engine", "EngineCapabilities", "NotDrivableError", "OgEngine", "OgGeneratorEngine", "OrtCpuEngine"]
