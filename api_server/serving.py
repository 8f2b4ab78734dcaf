"""The two generation endpoints, /v1/chat/completions and /v1/completions.

Both follow one path: check the model name and the request's sizes (api_server.request_limits,
on the event loop, cheap), then the supported fields, structured outputs and tools (in a
prepare thread: schema checks are slow), build one ``TextGenerationRequest`` per prompt with
everything it asks for, tokenize each into a ``TextContext`` (in a prepare thread too; errors →
400), fan each out into ``n`` choices, submit them all, and answer either one JSON body or an
SSE stream of ``data: {json}`` events ending with ``data: [DONE]``. The endpoints differ only
in their ``ResponseFormat`` (api_server.formats). Chat messages may hold images
(api_server.images), whose shared-memory segments the choices share with their one owner
(``api_server.image_segments.ImageSegments``); completions take none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import msgspec
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from api_server.choices import Choice, ChoiceDelta, EchoedLogprobs, Generation, choice_context
from api_server.config import ApiServerConfig, RequestLimits
from api_server.engine_client import EngineClient, SchedulerUnavailable
from api_server.errors import (
    OpenAIError,
    invalid_request,
    model_not_found,
    no_generation_model,
    overloaded,
    server_error,
    service_unavailable,
)
from api_server.formats import ChatFormat, CompletionFormat, ResponseFormat
from api_server.generation_config import with_default_max_new_tokens, with_generation_defaults
from api_server.image_segments import ImageSegments
from api_server.images import check_images_accepted, image_inputs, load_images
from api_server.logprobs import TokenTexts
from api_server.metrics import ServerMetrics
from api_server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from api_server.reasoning import (
    REASONING_TAGS,
    ReasoningParsing,
    prompt_tail_token_ids,
    reasoning_parsing,
)
from api_server.request_builder import (
    chat_generation_request,
    check_supported,
    completion_generation_requests,
    sampling_params,
)
from api_server.request_id import current_request_id, engine_request_id
from api_server.request_limits import OutputBudget, check_request_limits
from api_server.structured_output import structured_output
from api_server.text_stream import GenerationStream, RequestFailed, TextOptions
from api_server.tokenizer import HuggingFaceTokenizer
from api_server.tools import ToolCalling, chat_constraint, tool_calling
from interfaces import (
    ErrorKind,
    TextContext,
    TextGenerationRequest,
)
from interfaces.lora import lora_name_problem

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerState:
    """What every route of one API server process shares; built by the app's lifespan."""

    config: ApiServerConfig
    tokenizer: HuggingFaceTokenizer | None
    """The text generation model's; None when the server serves only embeddings, and then
    ``check_model``, which every route that uses it calls first, answers 404."""
    engine: EngineClient
    metrics: ServerMetrics
    token_texts: TokenTexts | None = field(init=False)
    draining: bool = field(default=False, init=False)
    """Set on SIGTERM: new generations get 503 while those in flight finish."""

    def __post_init__(self) -> None:
        self.token_texts = None if self.tokenizer is None else TokenTexts(self.tokenizer.backend)

    @property
    def request_limits(self) -> RequestLimits:
        return self.config.request_limits

    @property
    def model_name(self) -> str | None:
        """The text generation model's name for clients (None: none is served)."""
        return self.config.served_model_name

    def check_accepting(self) -> None:
        """503 while the server drains for shutdown (a load balancer should send elsewhere)."""
        if self.draining:
            raise service_unavailable("the server is shutting down")

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is None (the served model, as vLLM allows) or its name, and a
        text generation model is served."""
        if self.tokenizer is None:
            raise no_generation_model(model, model == self.config.embedding_name)
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    async def resolve_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names, None for the base model (or no name); 404 for any
        other name, as ``check_model``. The adapters are those of the scheduler's last stats
        reply; while LoRA may be enabled, a name not among them that could name an adapter
        asks the scheduler again, so an adapter loaded through another API server is found at
        once."""
        if self.tokenizer is None or model is None or model == self.model_name:
            self.check_model(model)
            return None
        engine = self.engine
        could_be_adapter = engine.max_loras != 0 and lora_name_problem(model) is None
        if model not in engine.lora_names and could_be_adapter:
            with contextlib.suppress(SchedulerUnavailable):
                await engine.stats()  # the engine takes the adapters from the reply
        if model not in engine.lora_names:
            raise model_not_found(model)
        return model


async def create_chat_completion(request: ChatCompletionRequest, state: ServerState) -> Response:
    """Answer POST /v1/chat/completions (a JSONResponse or a StreamingResponse)."""
    response_id = f"chatcmpl-{current_request_id()}"
    generation, response_format = await start_chat_generation(request, state, response_id)
    return await _respond(request, generation, response_format)


async def start_chat_generation(
    request: ChatCompletionRequest, state: ServerState, response_id: str
) -> tuple[Generation, ChatFormat]:
    """Check ``request``, tokenize it and submit its choices: the generation, and the
    ``ChatFormat`` that parses its text (tools, reasoning). Every check is a 400 before anything
    is queued. The caller starts ``generation.deltas()`` before its next await: from then on
    that closes the choices' image segments however it ends (api_server.open_responses shapes
    the same generation as a Responses API answer)."""
    arrival_time = time.monotonic()
    lora_name = await state.resolve_model(request.model)
    state.check_accepting()
    request = with_generation_defaults(request, state.config.generation_defaults)
    check_request_limits(request, state.request_limits, state.tokenizer.max_model_len)
    tools, prompt = await state.tokenizer.run_in_thread(
        _checked_chat_request, request, state, engine_request_id(response_id)
    )
    options = _text_options(request)
    markers = set(tools.markers if tools is not None else ())
    if state.config.reasoning_parser is not None:
        markers.update(REASONING_TAGS)
    if state.tokenizer.special_token_texts & markers:
        # The parsers must see tags that are special tokens (vLLM does the same).
        options = dataclasses.replace(options, skip_special_tokens=False)
    inputs = image_inputs(request.messages)
    check_images_accepted(inputs, state.tokenizer.why_no_images, state.model_name)
    vision, max_model_len = state.tokenizer.vision, state.tokenizer.max_model_len
    images = await load_images(inputs, state.config.media, vision, max_model_len)
    if images:
        prompt = msgspec.structs.replace(prompt, images=images)
    generation = await _generation(state, request, [prompt], options, arrival_time, lora_name)
    # No await until the caller starts ``Generation.deltas``: from there on that closes the
    # generation's image segments however it ends; before, this does.
    try:
        response_format = ChatFormat(
            response_id,
            lora_name or state.model_name,
            request.num_logprobs,
            state.token_texts,
            tools,
            _reasoning_parsing(state, generation, prompt),
        )
    except BaseException:
        for choice in generation.choices:
            choice.stream.images.close()
        raise
    return generation, response_format


async def create_completion(request: CompletionRequest, state: ServerState) -> Response:
    """Answer POST /v1/completions (a JSONResponse or a StreamingResponse)."""
    arrival_time = time.monotonic()
    lora_name = await state.resolve_model(request.model)
    state.check_accepting()
    request = with_generation_defaults(request, state.config.generation_defaults)
    check_request_limits(request, state.request_limits, state.tokenizer.max_model_len)
    response_id = f"cmpl-{current_request_id()}"
    request_id = engine_request_id(response_id)
    prompts = await state.tokenizer.run_in_thread(
        _checked_completion_requests, request, state, request_id
    )
    options = _text_options(request)
    response_format = CompletionFormat(
        response_id, lora_name or state.model_name, request.num_logprobs, state.token_texts
    )
    generation = await _generation(state, request, prompts, options, arrival_time, lora_name)
    return await _respond(request, generation, response_format)


def _checked_chat_request(
    request: ChatCompletionRequest, state: ServerState, request_id: str
) -> tuple[ToolCalling | None, TextGenerationRequest]:
    """The request's tools and the request itself, still without its images; a 400 for
    anything unsupported or invalid. CPU work (meta-validating schemas, one wire message per
    chat message): run it in a prepare thread."""
    check_supported(request)
    max_bytes = state.request_limits.max_structured_output_bytes
    tools = tool_calling(request, max_bytes)
    constraint = chat_constraint(request, tools, max_bytes)
    params = sampling_params(
        request, state.tokenizer.vocab_size, state.config.logits_processor_names
    )
    prompt_tools = None if tools is None else tools.tools
    return tools, chat_generation_request(request, request_id, params, prompt_tools, constraint)


def _reasoning_parsing(
    state: ServerState, generation: Generation, prompt: TextGenerationRequest
) -> ReasoningParsing | None:
    """How the choices parse reasoning (None: ``--reasoning-parser`` is not set, or the output
    is constrained); whether the output starts inside the reasoning depends on the end of the
    prompt, which they share.

    A constrained output (``response_format``, a required or named tool, ``guided_*``) follows
    its grammar from the first token, so the model writes no reasoning: all of it is content
    (vLLM instead lets the grammar start after the reasoning, which this engine cannot yet)."""
    if state.config.reasoning_parser is None or prompt.structured_output is not None:
        return None
    prompt_token_ids = generation.choices[0].stream.context.prompt_token_ids
    tail = state.tokenizer.backend.decode(
        prompt_tail_token_ids(prompt_token_ids), skip_special_tokens=False
    )
    return reasoning_parsing(state.config.reasoning_parser, tail)


def _checked_completion_requests(
    request: CompletionRequest, state: ServerState, request_id: str
) -> list[TextGenerationRequest]:
    """One request per prompt, as ``_checked_chat_request`` checks it."""
    check_supported(request)
    params = sampling_params(
        request, state.tokenizer.vocab_size, state.config.logits_processor_names
    )
    constraint = structured_output(request, state.request_limits.max_structured_output_bytes)
    return completion_generation_requests(request, request_id, params, constraint)


async def _generation(
    state: ServerState,
    request: SamplingFields,
    prompts: list[TextGenerationRequest],
    options: TextOptions,
    arrival_time: float,
    lora_name: str | None = None,
) -> Generation:
    """Tokenize every prompt once and make ``n`` choices of each (index prompt * n + sample),
    generated with LoRA adapter ``lora_name`` (None: the base model).

    Each choice is one request in the metrics; the prompt's tokens count with its first. A
    prompt's choices share its image segments and their owner (``ImageSegments``), and the
    log probabilities of its tokens when they echo it (``EchoedLogprobs``: only the first
    choice's request asks for them). Once a
    prompt is tokenized, its choices' output tokens count against
    ``--max-request-output-tokens`` (``OutputBudget``). If anything here fails, every image
    segment made so far is unlinked."""
    n = request.num_choices_per_prompt
    several = len(prompts) * n > 1
    budget = OutputBudget(state.request_limits, state.tokenizer.max_model_len, n)
    backend = state.tokenizer.backend
    choices, num_prompt_tokens = [], 0
    owners: list[ImageSegments] = []
    try:
        for prompt in prompts:
            if lora_name is not None:
                prompt = msgspec.structs.replace(prompt, lora_name=lora_name)
            images = ImageSegments()
            owners.append(images)
            context = await _new_context(state, prompt, images)
            choice_contexts = [context]
            if several:
                first_index = prompt.index * n
                choice_contexts = [
                    choice_context(context, prompt.request_id, first_index + sample, sample)
                    for sample in range(n)
                ]
            budget.add(context)
            num_prompt_tokens += context.num_prompt_tokens
            echo_text = _echo_text(state, prompt, context) if prompt.echo else None
            echoed = None
            if context.prompt_logprobs is not None and n > 1:  # the first choice computes them
                echoed = EchoedLogprobs()
                choice_contexts[1:] = [
                    msgspec.structs.replace(later, prompt_logprobs=None)
                    for later in choice_contexts[1:]
                ]
            for sample, context_of_choice in enumerate(choice_contexts):
                num_prompt_tokens_counted = context.num_prompt_tokens if sample == 0 else 0
                metrics = state.metrics.request(arrival_time, num_prompt_tokens_counted)
                stream = GenerationStream(
                    state.engine, context_of_choice, backend, options, metrics, images
                )
                choices.append(
                    Choice(prompt.index * n + sample, stream, echo_text, echoed, sample == 0)
                )
    except BaseException:
        for images in owners:
            images.close()
        raise
    return Generation(choices, num_prompt_tokens)


def _text_options(request: SamplingFields) -> TextOptions:
    return TextOptions(
        stop=tuple(request.stop_strings),
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        discard_output=request.max_new_tokens == 0,
    )


async def _new_context(
    state: ServerState, request: TextGenerationRequest, images: ImageSegments
) -> TextContext:
    try:
        context = await state.tokenizer.new_context(request, images)
    except ValueError as error:
        param = "messages" if request.messages is not None else "prompt"
        raise invalid_request(str(error), param=param) from error
    config = state.config
    try:
        return with_default_max_new_tokens(
            context, config.generation_defaults, config.max_new_tokens_limit
        )
    except ValueError as error:
        raise invalid_request(str(error), param="min_tokens") from error


def _echo_text(state: ServerState, request: TextGenerationRequest, context: TextContext) -> str:
    """The prompt as text: as given, or its token ids decoded (special tokens kept)."""
    if isinstance(request.prompt, str):
        return request.prompt
    return state.tokenizer.backend.decode(context.prompt_token_ids, skip_special_tokens=False)


async def _respond(
    request: SamplingFields, generation: Generation, response_format: ResponseFormat
) -> Response:
    if request.stream:
        return await _stream_response(generation, response_format, request.include_usage)
    return await _full_response(generation, response_format)


def as_openai_error(error: RequestFailed | SchedulerUnavailable) -> OpenAIError:
    if isinstance(error, SchedulerUnavailable):
        return service_unavailable(str(error))
    if error.kind is ErrorKind.INVALID_REQUEST:
        return invalid_request(str(error))
    if error.kind is ErrorKind.NOT_FOUND:
        return OpenAIError(404, str(error), "NotFoundError", "model", "model_not_found")
    if error.kind is ErrorKind.OVERLOADED:
        return overloaded(str(error))
    if error.kind is ErrorKind.UNAVAILABLE:
        return service_unavailable(str(error))
    return server_error(str(error))


async def _full_response(generation: Generation, response_format: ResponseFormat) -> JSONResponse:
    try:
        choices = await generation.collect()
    except (RequestFailed, SchedulerUnavailable) as error:
        raise as_openai_error(error) from error
    body = response_format.response(choices, generation.usage())
    return JSONResponse(body.model_dump(mode="json"))


async def _stream_response(
    generation: Generation, response_format: ResponseFormat, include_usage: bool
) -> StreamingResponse:
    deltas, first = await first_delta(generation)
    return event_stream(_sse_events(generation, deltas, first, response_format, include_usage))


async def first_delta(
    generation: Generation,
) -> tuple[AsyncGenerator[ChoiceDelta, None], ChoiceDelta]:
    """Start ``generation.deltas()`` and wait for the scheduler's first result before any
    header is sent, so a request that fails at once (scheduler down, request refused) gets a
    real HTTP status instead of an SSE error: (the deltas, the first)."""
    deltas = generation.deltas()
    try:
        return deltas, await anext(deltas)
    except (RequestFailed, SchedulerUnavailable) as error:
        raise as_openai_error(error) from error


def event_stream(events: AsyncGenerator[str, None]) -> StreamingResponse:
    """``events`` (SSE lines) as the response. Starlette does not close the body iterator when
    the client goes away mid-send; closing it in the background task aborts the request at once
    instead of whenever it is collected."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers=SSE_HEADERS,
        background=BackgroundTask(events.aclose),
    )


async def _sse_events(
    generation: Generation,
    deltas: AsyncGenerator[ChoiceDelta, None],
    first: ChoiceDelta,
    response_format: ResponseFormat,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE lines for one response; closing this generator early (client gone) aborts every
    choice. Choices interleave; each ends with exactly one chunk carrying its finish reason."""
    try:
        for chunk in response_format.opening_chunks([c.index for c in generation.choices]):
            yield _sse(chunk)
        delta: ChoiceDelta | None = first
        while delta is not None:
            for chunk in _delta_chunks(delta, response_format):
                yield _sse(chunk)
            delta = await anext(deltas, None)
        if include_usage:
            yield _sse(response_format.usage_chunk(generation.usage()))
    except (RequestFailed, SchedulerUnavailable) as error:
        yield _sse(as_openai_error(error).body())
    except OpenAIError as error:  # e.g. StreamBacklogFull: the client stopped reading
        yield _sse(error.body())
    finally:
        await deltas.aclose()
    yield SSE_DONE


def _delta_chunks(delta: ChoiceDelta, response_format: ResponseFormat) -> list[BaseModel]:
    chunk = response_format.delta_chunk(delta)
    chunks = [] if chunk is None else [chunk]
    if delta.finish_reason is not None:
        chunks.append(response_format.finish_chunk(delta.index, delta.finish_reason))
    return chunks


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"
