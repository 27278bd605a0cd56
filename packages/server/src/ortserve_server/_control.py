"""Model control routes (extension): load and unload a configured model by name.

The shape is the one llama-server's router mode and LM Studio converged on: ``POST
/models/load`` and ``POST /models/unload`` with ``{"model": NAME}`` in the body (a name in
the body, not the path, since model ids may hold ``/`` and ``:``). Only the names the
server was configured with can be loaded: nothing from the network names a folder.
"""

from __future__ import annotations

from litestar import post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p
from ortserve_runtime import AdapterNotFoundError

from ._errors import ModelNotFoundHTTPError
from ._leases import parse_keep_alive
from ._mapping import model_adapters, split_adapter
from ._openapi import POST_ERRORS, error_responses
from ._routes import model_card
from ._state import OrtServe

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


control_route_handlers = [load_model, unload_model]
