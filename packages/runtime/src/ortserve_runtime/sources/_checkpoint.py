"""A transformers checkpoint (``config.json`` and safetensors) built into a genai folder by
onnxruntime-genai's own model builder, run in a child process.

The builder knows some forty architectures; it needs torch, transformers and onnx-ir
(ortserve-runtime's ``checkpoints`` extra), which the server itself never imports: the
child has them, or the model fails with a message naming the extra. A child also keeps
the builder's memory (it holds the model in fp32 while it quantizes) and its GIL out of
the server: other models keep serving while one builds.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ._child import ended_by, run_child
from ._names import CheckpointPrecision, SourceError

__all__ = ["BUILDER_OPTIONS", "BUILD_VERSION", "build_checkpoint", "builder_provider"]

logger = logging.getLogger(__name__)

BUILDER_OPTIONS: dict[CheckpointPrecision, tuple[str, ...]] = {
    # int4: k_quant with the last matrix (the LM head) and the layers most sensitive to
    # rounding in int8: on SmolLM2 it answers where the builder's default int4 (round to
    # nearest for every matrix) does not (shared/tools/mk_smollm2.py's report), at
    # 0.8-0.9x its decode speed.
    "int4": ("algo_config=k_quant_mixed",),
    "int8": (),
    "fp16": (),
    "fp32": (),
}
"""The builder's ``--extra_options`` for each precision."""

BUILD_VERSION = 1
"""Part of every built folder's cache key (with og's version): raise it when
:data:`BUILDER_OPTIONS` or what is written beside the builder's files changes."""

_RUN_BUILDER = """
import os, runpy, sys, threading, time
parent = os.getppid()
def watch():  # end with the server rather than build on alone
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)
threading.Thread(target=watch, daemon=True).start()
sys.argv[0] = "builder"
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""
"""``python -m onnxruntime_genai.models.builder ARGS`` that exits when its parent does."""

_PROVIDERS = {"cpu": "cpu", "cuda": "cuda", "dml": "dml", "webgpu": "webgpu", "trt-rtx": "NvTensorRtRtx"}
_NEEDED = ("torch", "transformers", "onnx_ir")
_LAYER = re.compile(r"Reading (?:decoder )?layer (\d+)")
_QUANTIZED = "complete quantization of"


_BUILDS: dict[CheckpointPrecision, tuple[str, ...]] = {
    "int4": ("cpu", "cuda", "dml", "webgpu"),
    "int8": ("cpu", "cuda", "webgpu"),
    "fp16": ("cuda", "dml", "trt-rtx"),
    "fp32": ("cpu", "cuda"),
}
"""The providers og 0.18's builder writes each precision for (its own table): other pairs
it builds without complaint into folders that do not run (fp16 on the CPU, measured)."""


def builder_provider(precision: CheckpointPrecision, provider: str) -> str:
    """The builder's ``-e`` for ``precision`` on one of ortserve's providers;
    ``SourceError`` for a pair it does not build."""
    if provider not in _PROVIDERS:
        raise SourceError(
            f"og's model builder writes no folders for the {provider} provider "
            f"(it builds for {', '.join(_PROVIDERS)}); build one elsewhere and serve the folder"
        )
    if provider not in _BUILDS[precision]:
        raise SourceError(
            f"og's model builder writes no {precision} folders for the {provider} provider "
            f"({precision} is built for {', '.join(_BUILDS[precision])}); choose another quantize"
        )
    return _PROVIDERS[provider]


def build_checkpoint(
    source: Path,
    folder: Path,
    precision: CheckpointPrecision,
    provider: str,
    progress: Callable[[float], None] = lambda fraction: None,
) -> None:
    """Write the genai folder of the checkpoint ``source`` into ``folder`` (which exists)
    with og's builder in a child process; ``SourceError`` with the builder's own reason
    when it fails."""
    missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise SourceError(
            f"building the checkpoint {source} needs torch, transformers and onnx-ir (missing: "
            f"{', '.join(missing)}): install ortserve-runtime's checkpoints extra, "
            "pip install 'ortserve-runtime[checkpoints]', or build the folder with "
            "python -m onnxruntime_genai.models.builder and serve that"
        )
    layers = _layer_count(source)
    scratch = Path(tempfile.mkdtemp(prefix="builder-", dir=folder.parent))
    command = [
        sys.executable,
        "-c",
        _RUN_BUILDER,
        "-i",
        str(source),
        "-o",
        str(folder),
        "-p",
        precision,
        "-e",
        builder_provider(precision, provider),
        "-c",
        str(scratch),
    ]
    if BUILDER_OPTIONS[precision]:
        command += ["--extra_options", *BUILDER_OPTIONS[precision]]
    logger.info("building %s (%s, %s) with og's builder", source, precision, provider)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    quantized = 0

    def on_line(line: str) -> None:
        nonlocal quantized
        tail.append(line.rstrip())
        logger.debug("builder: %s", line)
        if match := _LAYER.search(line):
            progress(0.5 * (int(match[1]) + 1) / layers)
        elif _QUANTIZED in line:
            quantized += 1  # about seven matrices a layer, and the LM head
            progress(0.5 + 0.45 * min(1.0, quantized / (7 * layers + 1)))
        elif line.startswith("Saving GenAI config"):
            progress(0.97)

    try:
        code = run_child(command, on_line, env={**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if code != 0 or not (folder / "genai_config.json").exists():
        raise SourceError(f"og's model builder could not build {source}: {_reason(tail, code)}")
    (folder / "ortserve_source.json").write_text(
        json.dumps(
            {
                "source": str(source),
                "builder": "onnxruntime_genai.models.builder",
                "precision": precision,
                "execution_provider": builder_provider(precision, provider),
                "extra_options": list(BUILDER_OPTIONS[precision]),
            },
            indent=2,
        ),
        encoding="utf-8",
    )


def _layer_count(source: Path) -> int:
    """The checkpoint's layer count (for progress; 1 where config.json does not say)."""
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        for section in (config, config.get("text_config") or {}):
            if isinstance(section.get("num_hidden_layers"), int) and section["num_hidden_layers"] > 0:
                return int(section["num_hidden_layers"])
    return 1


def _reason(tail: collections.deque[str], code: int) -> str:
    """The builder's own words for its failure: the exception's last line, else the end
    of what it printed."""
    lines = [line.strip() for line in tail if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line):
            return line
    ended = ended_by(code)
    if ended is not None:
        return f"it was ended by {ended}"
    return " / ".join(lines[-3:]) or f"it exited with status {code}"
