"""Execution providers: one name per accelerator, mapped to what onnxruntime-genai and
onnxruntime call it, and the load errors that say what to install.

Availability is checked by loading, never by asking: ``og.is_webgpu_available()`` (and the
QNN and OpenVINO checks) answer True in the CPU wheel, whose loads then fail.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from ._errors import ModelLoadError

log = logging.getLogger("ortserve.providers")

__all__ = [
    "PROVIDERS",
    "Provider",
    "apply_og_provider",
    "check_provider",
    "check_session_provider",
    "install_hint",
    "og_load_error",
    "ort_providers",
]

Provider = Literal["cpu", "cuda", "dml", "qnn", "openvino", "webgpu", "trt-rtx"]
PROVIDERS: tuple[Provider, ...] = get_args(Provider)

_OG_NAMES: dict[Provider, str] = {
    "cuda": "cuda",
    "dml": "dml",
    "qnn": "QNN",
    "openvino": "OpenVINO",
    "webgpu": "WebGPU",
    "trt-rtx": "NvTensorRtRtx",
}
"""``og.Config.append_provider`` names (the CPU is what remains after ``clear_providers``)."""

_ORT_NAMES: dict[Provider, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "dml": "DmlExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "trt-rtx": "NvTensorRTRTXExecutionProvider",
}

_INSTALL: dict[Provider, str] = {
    "cpu": 'the cpu extra (pip install "ortserve-runtime[cpu]")',
    "cuda": 'the cuda extra (pip install "ortserve-runtime[cuda]": onnxruntime-genai-cuda, onnxruntime-gpu and '
    "the CUDA 13 and cuDNN 9 libraries) and an NVIDIA driver for CUDA 13",
    "dml": 'the directml extra on Windows (pip install "ortserve-runtime[directml]")',
    "qnn": "onnxruntime-qnn and an onnxruntime-genai build with QNN (Windows on Snapdragon)",
    "openvino": 'the openvino extra (pip install "ortserve-runtime[openvino]": onnxruntime-openvino, which '
    "onnxruntime-genai's CPU wheel also loads)",
    "webgpu": "an onnxruntime-genai build with WebGPU (the PyPI CPU wheel lacks it)",
    "trt-rtx": "an onnxruntime-genai build with TensorRT-RTX and an NVIDIA RTX GPU",
}


def install_hint(provider: Provider) -> str:
    """What to install to run on ``provider``."""
    return _INSTALL[provider]


def check_provider(provider: str) -> Provider:
    """``provider`` as a :data:`Provider`, or ``ValueError`` listing the known ones."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    return provider


@functools.cache
def _load_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries the ``nvidia-*`` wheels of the cuda extra put in
    site-packages (onnxruntime's ``preload_dlls``), once per process: neither onnxruntime's
    CUDA provider nor onnxruntime-genai's looks there, so without it they load only from
    the library path (measured: ``libcublasLt.so.13: cannot open shared object file``).
    Libraries found on the library path instead (a CUDA install) load as before."""
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # it prints what it could not load
        try:
            preload(cuda=True, cudnn=True)
        except Exception as exc:  # noqa: BLE001  # the load that follows names what is missing
            log.debug("onnxruntime.preload_dlls failed: %s", exc)
    for line in said.getvalue().splitlines():
        log.debug("onnxruntime.preload_dlls: %s", line)


def apply_og_provider(config: Any, provider: Provider, options: Mapping[str, str]) -> None:
    """Point an ``og.Config`` at ``provider`` (replacing the folder's own choice)."""
    config.clear_providers()
    if provider == "cpu":
        return  # ModelConfig refuses provider options for the CPU
    if provider == "cuda":
        _load_cuda_libraries()
    name = _OG_NAMES[provider]
    config.append_provider(name)
    for key, value in options.items():
        config.set_provider_option(name, key, str(value))


def og_load_error(folder: Path, provider: Provider, exc: BaseException) -> ModelLoadError:
    """The error for a folder onnxruntime-genai could not load on ``provider``."""
    if provider == "cpu":
        return ModelLoadError(f"{folder} could not be loaded by onnxruntime-genai: {exc}", path=folder)
    return ModelLoadError(
        f"cannot load {folder} on provider {provider!r}: {exc}. To run on {provider}, install "
        f"{install_hint(provider)}, or choose another provider (--provider cpu)",
        path=folder,
    )


def ort_providers(
    provider: Provider, options: Mapping[str, str], folder: Path
) -> list[str | tuple[str, dict[str, str]]]:
    """The ``providers`` argument of ``ort.InferenceSession`` for ``provider``.

    A provider this onnxruntime lacks is a :class:`ModelLoadError` naming it and what to
    install: never a silent CPU fallback.
    """
    import onnxruntime as ort

    if provider == "cpu":
        return ["CPUExecutionProvider"]
    if provider == "cuda":
        _load_cuda_libraries()
    name = _ORT_NAMES[provider]
    if name not in ort.get_available_providers():
        raise ModelLoadError(
            f"cannot load {folder} on provider {provider!r}: this onnxruntime has no {name} "
            f"(it has {', '.join(ort.get_available_providers())}). Install {install_hint(provider)}",
            path=folder,
        )
    return [(name, dict(options)), "CPUExecutionProvider"]


def check_session_provider(session: Any, provider: Provider, folder: Path) -> None:
    """Fail loudly when onnxruntime quietly built a session without ``provider`` (an
    option it rejects, such as OpenVINO's ``precision: BF16``, gives a CPU-only session)."""
    name = _ORT_NAMES[provider]
    if name not in session.get_providers():
        raise ModelLoadError(
            f"cannot load {folder} on provider {provider!r}: onnxruntime created the session without "
            f"{name} (check the provider options)",
            path=folder,
        )
