"""Model control routes (extension): load and unload a configured model by name, and
LoRA adapters of a served model.

The model routes take the shape llama-server's router mode and LM Studio converged on:
``POST /models/load`` and ``POST /models/unload`` with ``{"model": NAME}`` in the body (a
name in the body, not the path, since model ids may hold ``/`` and ``:``). Only the names
the server was configured with can be loaded: nothing from the network names a folder.

The adapter routes are vLLM's (``POST /load_lora_adapter`` with ``lora_name`` and
``lora_path``, ``POST /unload_lora_adapter``). They do name a file, so they answer only
where the server was started with ``--allow-runtime-adapters`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
"""

from __future__ import annotations

import logging
import os
import re

from litestar import post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p
from ortserve_runtime import AdapterNotFoundError, ModelLoadError

from .._errors import BadRequestError, ForbiddenError, ModelNotFoundHTTPError
from .._leases import model_adapters, parse_keep_alive, split_adapter
from .._openapi import POST_ERRORS, error_responses
from .._state import OrtServe
from .models import model_card

logger = logging.getLogger("ortserve.server")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What an adapter loaded over HTTP may be called: a model id's characters, no path."""

__all__ = ["control_route_handlers"]


def _configured(state: OrtServe, model_id: str) -> tuple[str, str | None]:
    """The configured model (and LoRA adapter) ``model_id`` names, else a 404: a name from
    the network never reaches the file system. An adapter loads and unloads with its model."""
    name, adapter = split_adapter(state, model_id)
    if name not in state.registry.names():
        raise ModelNotFoundHTTPError(
            f"model {name!r} is not configured on this server (it loads only the models it was started with)",
            param="model",
        )
    if adapter is not None and adapter not in model_adapters(state, name):
        raise AdapterNotFoundError(name, adapter, model_adapters(state, name))
    return name, adapter


@post(
    "/models/load",
    status_code=200,
    summary="Load a model (extension)",
    description="Loads a configured model (waiting for a load under way) and returns its status. "
    "`keep_alive` sets how long it stays loaded once idle. 503 + Retry-After when the "
    "model count or memory budget is reached and every loaded model is busy.",
    responses=error_responses(*POST_ERRORS),
)
async def load_model(data: JSONBody[p.ModelLoadRequest], ortserve: NamedDependency[OrtServe]) -> p.Model:
    name, adapter = _configured(ortserve, data.model)
    await ortserve.registry.load(name, keep_alive=parse_keep_alive(data.keep_alive))
    return model_card(ortserve, name, adapter)


@post(
    "/models/unload",
    status_code=200,
    summary="Unload a model (extension)",
    description="Waits for the requests using the model (up to the server's unload grace period; "
    "then they end with an error), frees it and returns its status. Requests that arrive "
    "meanwhile wait and load it again.",
    responses=error_responses(*POST_ERRORS),
)
async def unload_model(data: JSONBody[p.ModelUnloadRequest], ortserve: NamedDependency[OrtServe]) -> p.Model:
    name, adapter = _configured(ortserve, data.model)
    await ortserve.registry.unload(name)
    return model_card(ortserve, name, adapter)


def _adapter_of(state: OrtServe, lora_name: str, model: str | None) -> tuple[str, str]:
    """(model, adapter name) for vLLM's ``lora_name`` (``NAME`` or ``MODEL:NAME``) and our
    optional ``model``; 403 unless the server allows adapters over HTTP."""
    if not state.config.runtime_adapters:
        raise ForbiddenError(
            "loading LoRA adapters over HTTP is off on this server (start it with --allow-runtime-adapters)"
        )
    name, adapter = split_adapter(state, lora_name)
    if adapter is None:
        generative = [n for n in state.registry.names() if state.registry.kind(n) == "generative"]
        if model is None and len(generative) != 1:
            raise BadRequestError(
                f"name the model the adapter is for: 'model', or lora_name as MODEL:{lora_name} "
                f"(this server has {len(generative)} generative models)",
                param="model",
            )
        name, adapter = model or generative[0], lora_name
    elif model is not None and model != name:
        raise BadRequestError(f"lora_name {lora_name!r} names model {name!r}, not {model!r}", param="model")
    if name not in state.registry.names() or state.registry.kind(name) != "generative":
        raise ModelNotFoundHTTPError(f"no generative model {name!r} is served here", param="model")
    if not _ADAPTER_NAME.fullmatch(adapter) or ".." in adapter:
        raise BadRequestError(
            "lora_name's adapter name must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a "
            "letter or digit)",
            param="lora_name",
        )
    return name, adapter


@post(
    "/load_lora_adapter",
    status_code=200,
    summary="Serve a LoRA adapter (vLLM's route; needs --allow-runtime-adapters)",
    description="Checks the `.onnx_adapter` file at `lora_path` against the model and serves it as "
    "`MODEL:NAME` at once (and at every later load of the model); returns its card.",
    responses=error_responses(*POST_ERRORS),
)
async def load_lora_adapter(data: JSONBody[p.LoraAdapterLoadRequest], ortserve: NamedDependency[OrtServe]) -> p.Model:
    name, adapter = _adapter_of(ortserve, data.lora_name, data.model)
    try:
        await ortserve.registry.add_adapter(name, adapter, data.lora_path)
    except ModelLoadError as exc:  # the file: missing, unreadable, too large, not an adapter of this model
        # One answer whatever the reason, so that the route does not tell which files exist
        # or are readable; the operator finds the reason in the log.
        logger.warning("load_lora_adapter %s:%s refused: %s", name, adapter, exc)
        raise BadRequestError(
            f"lora_path is not a usable .onnx_adapter file for model {name!r} (the server log says why)",
            param="lora_path",
        ) from exc
    except ValueError as exc:  # the name: taken or not allowed; an engine without adapters
        raise BadRequestError(str(exc), param="lora_name") from exc
    await ortserve.adapters.add(name, adapter, os.path.abspath(data.lora_path))  # the same file after a restart
    return model_card(ortserve, name, adapter)


@post(
    "/unload_lora_adapter",
    status_code=200,
    summary="Stop serving a LoRA adapter (vLLM's route; needs --allow-runtime-adapters)",
    description="New requests naming the adapter get 404 at once; requests already running finish with it.",
    responses=error_responses(*POST_ERRORS),
)
async def unload_lora_adapter(
    data: JSONBody[p.LoraAdapterUnloadRequest], ortserve: NamedDependency[OrtServe]
) -> p.ModelDeleted:
    name, adapter = _adapter_of(ortserve, data.lora_name, data.model)
    await ortserve.registry.remove_adapter(name, adapter)  # AdapterNotFoundError: 404
    await ortserve.adapters.remove(name, adapter)
    return p.ModelDeleted(id=f"{name}:{adapter}")


control_route_handlers = [load_model, unload_model, load_lora_adapter, unload_lora_adapter]
