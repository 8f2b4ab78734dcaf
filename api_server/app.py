"""The FastAPI application of one API server process.

``create_app(config)`` loads the tokenizer at once (a bad model directory fails before the server
listens) and connects to the scheduler in the app's lifespan, inside uvicorn's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from api_server import lora_routes, utility_routes
from api_server.config import ApiServerConfig
from api_server.embeddings import EmbeddingModel, EmbeddingRequest, create_embeddings
from api_server.engine_client import EngineClient, SchedulerUnavailable
from api_server.errors import install_error_handlers, service_unavailable
from api_server.json_body import JsonRoute
from api_server.limits import RequestLimitsMiddleware
from api_server.lora_routes import adapter_cards
from api_server.metrics import METRICS_CONTENT_TYPE, ServerMetrics
from api_server.open_responses import (
    ResponsesRoute,
    create_response,
    delete_response,
    retrieve_response,
)
from api_server.protocol import ChatCompletionRequest, CompletionRequest
from api_server.request_id import RequestIdMiddleware
from api_server.response_store import ResponseStore
from api_server.responses import ModelCard, ModelList
from api_server.responses_request import ResponsesRequest
from api_server.security import JsonContentTypeMiddleware, install_security
from api_server.serving import ServerState, create_chat_completion, create_completion
from api_server.stats_tickets import SchedulerStatsCache
from api_server.tokenizer import HuggingFaceTokenizer
from api_server.utility_routes import package_version
from interfaces.scheduler_to_api import WORKER_STALLED, GroupAway, SchedulerStats

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
router = APIRouter(route_class=JsonRoute)
responses_router = APIRouter(route_class=ResponsesRoute)


def create_app(config: ApiServerConfig, bind_host: str | None = None) -> FastAPI:
    """A FastAPI app serving the OpenAI routes, /tokenize, /detokenize, /version, /health, /ready
    and /metrics for ``config``, behind its API key, CORS, JSON body and ``Host`` checks
    (api_server.security; ``bind_host`` is the address the server listens on, None: unknown,
    which checks no ``Host``) and its request limits (api_server.limits)."""
    tokenizer = None
    if config.model_dir is not None:
        tokenizer = HuggingFaceTokenizer(config.model_dir, config.max_model_len)
    embedding_model = None
    if config.embedding_model_dir is not None:
        embedding_model = EmbeddingModel.load(config.embedding_model_dir, config.embedding_name)
    metrics = ServerMetrics(config.served_model_name or embedding_model.name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = EngineClient(config.engine)
        await engine.start()
        app.state.scheduler_stats = SchedulerStatsCache(
            engine.stats, lambda: metrics.num_request_changes
        )
        app.state.server = ServerState(config, tokenizer, engine, metrics)
        try:
            yield
        finally:
            await engine.close()
            app.state.response_store.close()

    app = FastAPI(title="Switchyard", version=package_version(), lifespan=lifespan)
    app.state.tokenizer = tokenizer
    app.state.embedding_model = embedding_model
    app.state.response_store = ResponseStore(config.responses_store)  # opened on first use
    install_error_handlers(app)
    # Inside the API key check and CORS (added after it, so outer): a 413, 415 or 431 carries
    # CORS headers, and a client without the key gets its 401 first. A declared body size above
    # the limit is a 413 before its Content-Type is looked at.
    app.add_middleware(JsonContentTypeMiddleware)
    app.add_middleware(RequestLimitsMiddleware, limits=config.limits)
    install_security(app, config.api_key, config.allowed_origins, bind_host)
    app.add_middleware(RequestIdMiddleware)
    metrics.instrument(app)  # outermost: refusals (400, 401, 413, 415, 431) are counted too
    for routes in routers():
        app.include_router(routes)
    return app


def routers() -> tuple[APIRouter, ...]:
    """Every router of the app, the OpenAI routes first."""
    return (router, responses_router, utility_routes.router, lora_routes.router)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _scheduler_stats(request: Request) -> SchedulerStatsCache:
    return request.app.state.scheduler_stats


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _cancel_on_disconnect(request, create_chat_completion(body, _state(request)))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _cancel_on_disconnect(request, create_completion(body, _state(request)))


@responses_router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    store = request.app.state.response_store
    return await _cancel_on_disconnect(request, create_response(body, _state(request), store))


@responses_router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    return await retrieve_response(response_id, request.app.state.response_store)


@responses_router.delete("/v1/responses/{response_id}")
async def remove_response(response_id: str, request: Request) -> Response:
    return await delete_response(response_id, request.app.state.response_store)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = _state(request)
    state.check_accepting()
    model = request.app.state.embedding_model
    return await _cancel_on_disconnect(request, create_embeddings(body, model, state.engine))


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    """The served models, and the LoRA adapters loaded now (from stats at most
    ``STATS_MAX_AGE_S`` old; without them while the scheduler does not answer)."""
    state = _state(request)
    config = state.config
    cards = []
    if config.model_dir is not None:
        cards.append(
            ModelCard(
                id=config.served_model_name,
                root=config.served_model_name,  # as vLLM: never the directory's path
                max_model_len=config.max_model_len,
            )
        )
        with contextlib.suppress(SchedulerUnavailable):
            await _scheduler_stats(request).get()  # the engine takes the adapters from it
        cards += adapter_cards(state.engine.lora_adapters, config.served_model_name)
    embedding_model = request.app.state.embedding_model
    if embedding_model is not None:
        cards.append(
            ModelCard(
                id=embedding_model.name,
                root=embedding_model.name,
                max_model_len=embedding_model.max_input_tokens,
            )
        )
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while this process serves and requests can progress: the scheduler
    answers within ``stats_timeout_s``, and a worker group serves the model or one that served
    is away and its requests wait for it (``SchedulerStats.groups_away``: it died or was fenced
    as stalled, less than ``--worker-return-timeout`` ago). The body is ``{"status": "ok"}``,
    or while groups are away ``{"status": "stalled" | "restarting", "groups_away": [{"group":
    NAME, "reason": R, "seconds": S}]}`` ("stalled" if any was fenced as stalled; the launcher
    restarts the groups named). 503 otherwise: a lost or silent scheduler, no worker and none
    expected back (including while the model loads), no embedding worker for a served
    embedding model. Draining for shutdown is still alive."""
    stats = await _peer_stats(request)
    if isinstance(stats, str):
        return service_unavailable(stats).response()
    away = stats.groups_away
    problem = _worker_problem(_state(request).config, stats, groups_may_return=bool(away))
    if problem is not None:
        return service_unavailable(problem).response()
    return JSONResponse(_health_body(away))


def _health_body(groups_away: list[GroupAway]) -> dict[str, Any]:
    """/health's body for these groups away (see ``health``)."""
    if not groups_away:
        return {"status": "ok"}
    stalled = any(group.reason == WORKER_STALLED for group in groups_away)
    return {
        "status": "stalled" if stalled else "restarting",
        "groups_away": [
            {"group": group.name, "reason": group.reason, "seconds": round(group.seconds, 1)}
            for group in groups_away
        ],
    }


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 when new requests can be served (the model is loaded, the scheduler and
    its worker are connected, and this server is not draining); 503 otherwise."""
    state = _state(request)
    problem = "the server is shutting down" if state.draining else await _peer_problem(request)
    if problem is not None:
        return service_unavailable(problem).response()
    return JSONResponse({"status": "ready"})


async def _peer_problem(request: Request) -> str | None:
    """Why the scheduler or its worker cannot serve now, or None."""
    stats = await _peer_stats(request)
    if isinstance(stats, str):
        return stats
    return _worker_problem(_state(request).config, stats)


async def _peer_stats(request: Request) -> SchedulerStats | str:
    """The scheduler's stats, or why it does not answer (from stats at most
    ``STATS_MAX_AGE_S`` old, so probes cost the scheduler little however many there are)."""
    state = _state(request)
    if state.engine.lost_connection is not None:
        return state.engine.lost_connection
    try:
        return await _scheduler_stats(request).get()
    except SchedulerUnavailable as error:
        return str(error)


def _worker_problem(
    config: ApiServerConfig, stats: SchedulerStats, groups_may_return: bool = False
) -> str | None:
    """Why no worker serves a model of ``config``, or None; missing workers are none while
    ``groups_may_return`` (groups are away, to be restarted, and text requests wait)."""
    if groups_may_return:
        return None
    if config.model_dir is not None and not stats.workers_ready:
        return "the scheduler is up but its workers are not ready"
    if config.embedding_model_dir is not None and not stats.embedding_workers_ready:
        return "the scheduler is up but its embedding worker is not ready"
    return None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition (api_server.metrics); without the scheduler's series while the
    scheduler does not answer. The scheduler's numbers are at most ``STATS_MAX_AGE_S`` old."""
    state = _state(request)
    try:
        state.metrics.update_scheduler(await _scheduler_stats(request).get())
    except SchedulerUnavailable as error:
        logger.warning("serving metrics without the scheduler's: %s", error)
        state.metrics.update_scheduler(None)
    return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)


async def _cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run ``work``, cancelling it if the client disconnects first (so its request is aborted).

    Starlette only notices a disconnect while streaming; this covers the time before the
    response starts, e.g. the whole of a non-streaming generation.
    """
    work_task = asyncio.ensure_future(work)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {work_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED
        )
    except BaseException:
        work_task.cancel()
        raise
    finally:
        disconnect_task.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work_task
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
