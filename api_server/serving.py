"""The two generation endpoints, /v1/chat/completions and /v1/completions.

Both follow one path: check the model name and the supported fields, build the
``TextGenerationRequest``, tokenize it into a ``TextContext`` (errors → 400), submit, and answer
either one JSON body or an SSE stream of ``data: {json}`` events ending with ``data: [DONE]``.
The endpoints differ only in their ``ResponseFormat`` (api_server.formats).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from api_server.config import ApiServerConfig
from api_server.engine_client import EngineClient, SchedulerUnavailable
from api_server.errors import (
    OpenAIError,
    invalid_request,
    model_not_found,
    server_error,
    service_unavailable,
)
from api_server.formats import ChatFormat, CompletionFormat, ResponseFormat
from api_server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from api_server.request_builder import (
    chat_generation_request,
    check_supported,
    completion_generation_request,
)
from api_server.responses import FinishReason
from api_server.text_stream import GenerationStream, RequestFailed, RequestRejected, TextDelta
from api_server.tokenizer import HuggingFaceTokenizer
from interfaces import TextGenerationRequest

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    """What every route of one API server process shares; built by the app's lifespan."""

    config: ApiServerConfig
    tokenizer: HuggingFaceTokenizer
    engine: EngineClient

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is None (the served model, as vLLM allows) or its name."""
        if model is not None and model != self.model_name:
            raise model_not_found(model)


async def create_chat_completion(request: ChatCompletionRequest, state: ServerState) -> Response:
    """Answer POST /v1/chat/completions (a JSONResponse or a StreamingResponse)."""
    state.check_model(request.model)
    check_supported(request)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation_request = chat_generation_request(request, request_id, state.model_name)
    return await _generate(
        state, request, generation_request, ChatFormat(request_id, state.model_name)
    )


async def create_completion(request: CompletionRequest, state: ServerState) -> Response:
    """Answer POST /v1/completions (a JSONResponse or a StreamingResponse)."""
    state.check_model(request.model)
    check_supported(request)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    generation_request = completion_generation_request(request, request_id, state.model_name)
    response_format = CompletionFormat(request_id, state.model_name)
    return await _generate(state, request, generation_request, response_format)


async def _generate(
    state: ServerState,
    request: SamplingFields,
    generation_request: TextGenerationRequest,
    response_format: ResponseFormat,
) -> Response:
    try:
        context = await state.tokenizer.new_context(generation_request)
    except ValueError as error:
        raise invalid_request(str(error), param=_prompt_param(generation_request)) from error
    stream = GenerationStream(
        state.engine,
        context,
        state.tokenizer.backend,
        request.stop_strings,
        request.skip_special_tokens,
    )
    if request.stream:
        return await _stream_response(stream, response_format, request.include_usage)
    return await _full_response(stream, response_format)


def _prompt_param(request: TextGenerationRequest) -> str:
    return "messages" if request.messages is not None else "prompt"


def _as_openai_error(error: Exception) -> OpenAIError:
    if isinstance(error, SchedulerUnavailable):
        return service_unavailable(str(error))
    if isinstance(error, RequestRejected):
        return invalid_request(str(error))
    return server_error(str(error))


async def _full_response(stream: GenerationStream, response_format: ResponseFormat) -> JSONResponse:
    pieces: list[str] = []
    finish_reason: FinishReason = "abort"
    try:
        async for delta in stream.deltas():
            pieces.append(delta.text)
            finish_reason = delta.finish_reason or finish_reason
    except (RequestFailed, SchedulerUnavailable) as error:
        raise _as_openai_error(error) from error
    body = response_format.response("".join(pieces), finish_reason, stream.usage())
    return JSONResponse(body.model_dump(mode="json"))


async def _stream_response(
    stream: GenerationStream, response_format: ResponseFormat, include_usage: bool
) -> StreamingResponse:
    """Wait for the scheduler's first result before sending headers, so a request that fails
    at once (scheduler down, request refused) gets a real HTTP status instead of an SSE error."""
    deltas = stream.deltas()
    try:
        first = await anext(deltas)
    except (RequestFailed, SchedulerUnavailable) as error:
        raise _as_openai_error(error) from error
    events = _sse_events(stream, deltas, first, response_format, include_usage)
    # Starlette does not close the body iterator when the client goes away mid-send; closing it
    # in the background task aborts the request at once instead of whenever it is collected.
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers=SSE_HEADERS,
        background=BackgroundTask(events.aclose),
    )


async def _sse_events(
    stream: GenerationStream,
    deltas: AsyncGenerator[TextDelta, None],
    first: TextDelta,
    response_format: ResponseFormat,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE lines for one request; closing this generator early (client gone) aborts it."""
    try:
        for chunk in response_format.opening_chunks():
            yield _sse(chunk)
        async for chunk in _delta_chunks(first, deltas, response_format):
            yield _sse(chunk)
        if include_usage:
            yield _sse(response_format.usage_chunk(stream.usage()))
    except (RequestFailed, SchedulerUnavailable) as error:
        yield _sse(_as_openai_error(error).body())
    finally:
        await deltas.aclose()
    yield SSE_DONE


async def _delta_chunks(
    first: TextDelta, deltas: AsyncIterator[TextDelta], response_format: ResponseFormat
) -> AsyncIterator[BaseModel]:
    delta: TextDelta | None = first
    while delta is not None:
        if delta.text:
            yield response_format.text_chunk(delta.text)
        if delta.finish_reason is not None:
            yield response_format.finish_chunk(delta.finish_reason)
            return
        delta = await anext(deltas, None)


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"
