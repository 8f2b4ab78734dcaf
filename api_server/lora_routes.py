"""LoRA adapters at run time, with vLLM's routes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.

Both are off unless the API server runs with ``--allow-runtime-lora-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a load makes every worker read a path the client names,
so a deployment turns it on only for clients it trusts with that (a 403 otherwise). Each
becomes MAX's ``LoRARequest``, which the scheduler carries to every rank of every worker
group (``scheduler.lora``); its ``LoRAStatus`` decides the answer. As vLLM: success is a 200
with a plain-text message, an unknown adapter to unload a 404, anything wrong with the adapter
or the request a 400 naming the problem. The path is read by the workers, on their hosts.
Once loaded, clients name the adapter as their ``model`` on any API server of the deployment,
and ``GET /v1/models`` lists it with its parent (``adapter_cards``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from api_server.engine_client import SchedulerUnavailable
from api_server.errors import OpenAIError, invalid_request, service_unavailable
from api_server.json_body import JsonRoute
from api_server.protocol import OpenAIBaseModel
from api_server.responses import ModelCard
from api_server.serving import ServerState
from interfaces.lora import (
    MAX_LORA_NAME_LENGTH,
    MAX_LORA_PATH_LENGTH,
    LoRAAdapterInfo,
    LoRAOperation,
    LoRARequest,
    LoRAResponse,
    LoRAStatus,
    lora_name_problem,
)

router = APIRouter(route_class=JsonRoute)

LORA_OPERATION_TIMEOUT_S = 120.0
"""How long a load or unload may take on the slowest group before the client gets 503 (a large
adapter read from a network file system)."""

_NOT_FOUND = (LoRAStatus.UNLOAD_NAME_NONEXISTENT,)
_UNAVAILABLE = (LoRAStatus.UNSPECIFIED_ERROR,)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_LENGTH)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_LENGTH)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_LENGTH)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    _check_name(state, body.lora_name)
    lora_request = LoRARequest(LoRAOperation.LOAD, body.lora_name, body.lora_path)
    return await _carry_out(state, lora_request, "lora_path")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> PlainTextResponse:
    state: ServerState = request.app.state.server
    state.check_model(None)  # 404 on a server that serves only embeddings
    lora_request = LoRARequest(LoRAOperation.UNLOAD, body.lora_name)
    return await _carry_out(state, lora_request, "lora_name")


def adapter_cards(adapters: list[LoRAAdapterInfo], parent: str) -> list[ModelCard]:
    """``/v1/models`` entries of the adapters, as vLLM lists them: the adapter's path as its
    root, the served model as its parent."""
    return [ModelCard(id=a.name, root=a.path, parent=parent) for a in adapters]


def _check_name(state: ServerState, name: str) -> None:
    """400 for a name clients could not use as their model: not a name, or a served model's."""
    state.check_model(None)
    problem = lora_name_problem(name)
    if problem is None and name in (state.model_name, state.config.embedding_name):
        problem = f"lora_name {name!r} is the name of a served model"
    if problem is not None:
        raise invalid_request(problem, param="lora_name")


async def _carry_out(
    state: ServerState, lora_request: LoRARequest, param: str
) -> PlainTextResponse:
    if not state.config.allow_runtime_lora_updating:
        raise OpenAIError(
            403,
            "loading and unloading LoRA adapters at run time is off: start the server with "
            "--allow-runtime-lora-updating",
            "invalid_request_error",
        )
    try:
        response = await state.engine.lora_operation(lora_request, LORA_OPERATION_TIMEOUT_S)
    except SchedulerUnavailable as error:
        raise service_unavailable(str(error)) from error
    if response.ok:
        return PlainTextResponse(response.message)
    raise _error(response, param)


def _error(response: LoRAResponse, param: str) -> OpenAIError:
    if response.status in _NOT_FOUND:
        return OpenAIError(404, response.message, "NotFoundError", "lora_name", "model_not_found")
    if response.status in _UNAVAILABLE:
        return service_unavailable(response.message)
    if response.status is LoRAStatus.LOAD_NAME_EXISTS:
        param = "lora_name"
    return invalid_request(response.message, param=param, code=response.status.value)
