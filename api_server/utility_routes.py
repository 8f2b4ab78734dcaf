"""Routes beside generation, as vLLM has them: POST /tokenize, POST /detokenize, GET /version.

/tokenize takes either a ``prompt`` (special tokens added unless ``add_special_tokens`` is false)
or chat ``messages`` (rendered with the chat template as a chat completion renders them:
``add_generation_prompt`` defaults to true, ``chat_template_kwargs`` such as
``{"enable_thinking": false}`` are template variables that may override it, as in vLLM, and
special tokens are not added again unless asked) and answers the token ids, their count
and the server's ``max_model_len``; for a vision-language model each image part counts as the
image tokens it becomes (the image itself is not fetched). /detokenize turns token ids back into
text, special tokens included. Neither talks to the scheduler.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, field_validator

from api_server.errors import invalid_request
from api_server.images import check_images_accepted, image_inputs
from api_server.json_body import JsonRoute
from api_server.protocol import (
    MAX_MESSAGES,
    ChatMessage,
    ChatTemplateKwargs,
    OpenAIBaseModel,
    few_message_parts,
)
from api_server.request_builder import check_message, check_unicode, generation_message
from api_server.request_limits import check_prompt_bytes, messages_bytes, text_bytes
from api_server.tokenizer import HuggingFaceTokenizer

router = APIRouter(route_class=JsonRoute)


class TokenizeRequest(OpenAIBaseModel):
    """Exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(
        default=None, max_length=MAX_MESSAGES, fail_fast=True
    )
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    """None: True for a prompt, False for messages (the template adds what it needs)."""
    chat_template_kwargs: ChatTemplateKwargs = None
    """Variables for the chat template of ``messages``, bounded as a chat completion's."""
    return_token_strs: bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _few_message_parts(cls, messages: Any) -> Any:
        return few_message_parts(messages)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int] = Field(fail_fast=True)


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = request.app.state.server
    await state.resolve_model(body.model)
    check_unicode(body)
    tokenizer: HuggingFaceTokenizer = state.tokenizer
    num_bytes = messages_bytes(body.messages or []) + text_bytes(body.prompt)
    limit = state.request_limits.prompt_bytes(tokenizer.max_model_len)
    check_prompt_bytes(num_bytes, limit, "prompt" if body.prompt is not None else "messages")
    token_ids = await tokenizer.run_in_thread(_token_ids, tokenizer, body, state.model_name)
    token_strs = None
    if body.return_token_strs:
        token_strs = [tokenizer.backend.id_to_token(token_id) or "" for token_id in token_ids]
    return TokenizeResponse(
        count=len(token_ids),
        max_model_len=tokenizer.max_model_len,
        tokens=token_ids,
        token_strs=token_strs,
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = request.app.state.server
    await state.resolve_model(body.model)
    tokenizer: HuggingFaceTokenizer = state.tokenizer
    if len(body.tokens) > tokenizer.max_model_len:
        raise invalid_request(
            f"{len(body.tokens)} tokens are more than the context length of "
            f"{tokenizer.max_model_len}",
            param="tokens",
        )
    try:
        return DetokenizeResponse(
            prompt=await tokenizer.run_in_thread(tokenizer.decode_checked, body.tokens)
        )
    except ValueError as error:
        raise invalid_request(str(error), param="tokens") from error


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=package_version())


def package_version() -> str:
    """Switchyard's installed version ("unknown" when it runs from a bare checkout)."""
    try:
        return metadata.version("switchyard")
    except metadata.PackageNotFoundError:
        return "unknown"


def _token_ids(
    tokenizer: HuggingFaceTokenizer, body: TokenizeRequest, model_name: str | None
) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("Give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        if body.chat_template_kwargs is not None:
            raise invalid_request(
                "chat_template_kwargs applies to messages, not a prompt",
                param="chat_template_kwargs",
            )
        add_special_tokens = body.add_special_tokens is not False
        return tokenizer.encode_now(body.prompt, add_special_tokens)
    messages = body.messages or []
    for index, message in enumerate(messages):
        check_message(index, message)
    images = image_inputs(messages)
    options = {
        "add_generation_prompt": body.add_generation_prompt,
        **(body.chat_template_kwargs or {}),
    }
    check_images_accepted(images, tokenizer.why_no_images, model_name)
    try:
        prompt = tokenizer.render_messages([generation_message(m) for m in messages], None, options)
        token_ids = tokenizer.encode_now(prompt, bool(body.add_special_tokens))
        if tokenizer.vision is not None:
            token_ids = tokenizer.vision.expand_image_tokens(token_ids, len(images))
    except ValueError as error:
        raise invalid_request(str(error), param="messages") from error
    return token_ids
