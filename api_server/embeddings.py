"""POST /v1/embeddings: OpenAI's embeddings endpoint, served by an embedding worker group.

Inputs are a string, a list of strings, a list of token ids or a list of such lists. Each is
tokenized with the embedding model's own tokenizer (its file's padding and truncation off: an
input longer than the model takes is a 400, never silently cut), submitted to the scheduler as
one ``EmbeddingsContext``, and answered with its vector as floats or as base64 of little-endian
float32, as OpenAI's ``encoding_format`` says.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi.responses import JSONResponse
from pydantic import Field, StrictInt, field_validator
from tokenizers import Tokenizer

from api_server.engine_client import EngineClient, SchedulerUnavailable
from api_server.errors import invalid_request, model_not_found, service_unavailable
from api_server.protocol import FAIL_FAST, OpenAIBaseModel, at_most_items
from api_server.serving import as_openai_error
from api_server.text_stream import RequestFailed
from interfaces import SchedulerStatus
from interfaces.embeddings import EmbeddingsContext, Pooling

MAX_INPUTS = 2048
"""OpenAI's limit on inputs per request."""
MAX_BYTES_PER_TOKEN = 64
"""An input text above this many UTF-8 bytes per token the model takes is refused before it is
tokenized: real text averages under 8, so it could never fit."""
MIN_INPUT_BYTES = 64 * 1024


class EmbeddingRequest(OpenAIBaseModel):
    model: str
    input: (
        str
        | Annotated[list[str], FAIL_FAST]
        | Annotated[list[StrictInt], FAIL_FAST]
        | Annotated[list[Annotated[list[StrictInt], FAIL_FAST]], FAIL_FAST]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _few_inputs(cls, inputs: Any) -> Any:
        """Counted before the inputs are validated (a list of ints is one input)."""
        return at_most_items(inputs, MAX_INPUTS, "inputs")


@dataclass(frozen=True)
class EmbeddingModel:
    """The embedding model an API server serves: its name, tokenizer and input limit."""

    name: str
    model_dir: Path
    tokenizer: Tokenizer
    max_input_tokens: int
    dimensions: int
    vocab_size: int

    @classmethod
    def load(cls, model_dir: Path, name: str) -> EmbeddingModel:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        config = _read_config(model_dir)
        max_positions = config.get("max_position_embeddings", 512)
        pooling = Pooling.of_model(model_dir, max_positions)
        return cls(
            name,
            model_dir,
            tokenizer,
            pooling.max_seq_length,
            config["hidden_size"],
            config.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True),
        )

    def token_ids(self, body: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids; a 400 naming what is wrong with the input."""
        inputs = body.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise invalid_request("input must not be empty", param="input")
        vocab_size = self.vocab_size  # the model's embedding table, not the tokenizer's
        result = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                token_ids = self._encode(index, item)
            elif any(not 0 <= token < vocab_size for token in item):
                raise invalid_request(
                    f"input {index} has token ids outside [0, {vocab_size})", param="input"
                )
            else:
                token_ids = list(item)
            if not item or not token_ids:
                raise invalid_request(f"input {index} is empty", param="input")
            if len(token_ids) > self.max_input_tokens:
                raise invalid_request(
                    f"input {index} has {len(token_ids)} tokens; this model takes at most "
                    f"{self.max_input_tokens}",
                    param="input",
                )
            result.append(token_ids)
        return result

    def _encode(self, index: int, text: str) -> list[int]:
        """``text``'s token ids; a 400 first if it is too long to ever fit. (``encode_batch_fast``,
        unlike ``encode``, lets the event loop run while it tokenizes.)"""
        max_bytes = max(MIN_INPUT_BYTES, MAX_BYTES_PER_TOKEN * self.max_input_tokens)
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > max_bytes:
            raise invalid_request(
                f"input {index} takes {num_bytes} bytes of text; this model takes at most "
                f"{self.max_input_tokens} tokens, so at most {max_bytes} bytes",
                param="input",
            )
        return self.tokenizer.encode_batch_fast([text])[0].ids


async def create_embeddings(
    body: EmbeddingRequest, model: EmbeddingModel | None, engine: EngineClient
) -> JSONResponse:
    """The OpenAI response for ``body`` (an OpenAIError for anything the client must fix).
    Cancelling it aborts the inputs not embedded yet."""
    if model is None or body.model != model.name:
        raise model_not_found(body.model)
    if body.dimensions is not None and body.dimensions != model.dimensions:
        raise invalid_request(
            f"this model's embeddings have {model.dimensions} dimensions; it cannot shorten them",
            param="dimensions",
        )
    inputs = await asyncio.to_thread(model.token_ids, body)  # up to 2,048 of them
    prefix = f"embd-{uuid.uuid4().hex}"
    contexts = [EmbeddingsContext(f"{prefix}-{i}", ids) for i, ids in enumerate(inputs)]
    try:
        results = await engine.embed(contexts)
    except SchedulerUnavailable as error:
        raise as_openai_error(error) from error
    data = []
    for index, context in enumerate(contexts):
        result = results[context.request_id]
        if result.status is SchedulerStatus.CANCELLED and result.error is None:
            raise service_unavailable("the request was cancelled: the server is shutting down")
        if result.status is not SchedulerStatus.COMPLETE or result.result is None:
            failure = RequestFailed(result.error or "the input was not embedded")
            failure.kind = result.error_kind or failure.kind
            raise as_openai_error(failure)
        vector = np.asarray(result.result.embeddings, dtype="<f4")
        data.append({"object": "embedding", "index": index, "embedding": _encode(vector, body)})
    num_tokens = sum(len(ids) for ids in inputs)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return JSONResponse({"object": "list", "data": data, "model": model.name, "usage": usage})


def _encode(vector: np.ndarray, body: EmbeddingRequest) -> list[float] | str:
    if body.encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector.tolist()


def _read_config(model_dir: Path) -> dict:
    from api_server.config import read_json

    return read_json(model_dir / "config.json")
