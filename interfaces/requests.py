"""Requests in MAX's vocabulary: what a client asked for, before and after tokenization.

``TextGenerationRequest`` is the API server's parsed view of one prompt of an OpenAI request,
built once with everything it asks for. ``TextContext`` is what ``PipelineTokenizer.new_context``
makes of it: token ids and the limits the scheduler needs. Only the context crosses the wire to
the scheduler; the request stays in the API server, which owns detokenization and the response
shape.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from interfaces.sampling import SamplingParams
from interfaces.shared_memory import SharedMemoryArray

RequestID = str
"""A unique, immutable identifier for a request (MAX's ``RequestID``)."""
MAX_REQUEST_ID_LENGTH = 256
"""The longest request id the scheduler takes (the API server's are under 160 characters)."""
MAX_LOGPROBS = 20
"""OpenAI's bound on ``top_logprobs`` and ``logprobs``: the most alternatives per token."""


class TextGenerationRequestFunction(msgspec.Struct, frozen=True, omit_defaults=True):
    """A function a tool call may invoke; ``parameters`` is a JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class TextGenerationRequestTool(msgspec.Struct, frozen=True, omit_defaults=True):
    """A tool definition, OpenAI's ``{"type": "function", "function": {...}}``."""

    function: TextGenerationRequestFunction
    type: str = "function"


class TextGenerationRequestMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    """One conversation turn. ``content`` is a string or a list of typed parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the generated text, applied as token masks by the worker.

    ``kind`` is "json_object" (any JSON object; ``spec`` None), "json_schema" (``spec`` is the
    schema as JSON text), "regex" (``spec`` is the pattern) or "grammar" (``spec`` is EBNF).
    """

    kind: Literal["json_object", "json_schema", "regex", "grammar"]
    spec: str | None = None


class ImageMetadata(msgspec.Struct, frozen=True, array_like=True):
    """One image of a request (MAX's ``ImageMetadata``): its preprocessed pixels, a float32
    array of shape (channels, height, width) in shared memory, and where its image tokens sit in
    the prompt, positions [``start_idx``, ``end_idx``). ``image_hash`` is a SHA-256 hex digest of
    the pixels (their dtype, shape and bytes); the prefix cache keys blocks that hold image
    tokens by it, so the same image reuses its KV and a different one never does.

    The API server creates the segment and owns it until the request's ``SubmitRequest`` is sent
    (``api_server.image_segments.ImageSegments``); from then on the scheduler unlinks it when
    the request ends (finished, aborted or failed); workers only map and copy it.
    """

    start_idx: int
    end_idx: int
    pixel_values: SharedMemoryArray
    image_hash: str


class PreparedImage(msgspec.Struct, frozen=True, array_like=True):
    """One image of a request, ready for the model but not yet placed in the prompt: its
    preprocessed pixels, a float32 array of shape (channels, height, width) in the API server's
    memory, and their hash (``ImageMetadata.image_hash``)."""

    pixels: np.ndarray
    image_hash: str


class TextGenerationRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """An immutable request for text generation (MAX's ``TextGenerationRequest``): one prompt
    of one OpenAI request, with everything its context is made of.

    Exactly one of ``prompt`` (completions) or ``messages`` (chat) is set. ``images`` (chat, a
    vision-language model) are in prompt order; ``PipelineTokenizer.new_context`` copies their
    pixels into shared memory. ``logprobs`` None asks for no log probabilities, k >= 0 for each
    token's and the k most likely alternatives (of the prompt's too with ``echo``, which puts
    the prompt before the completion). ``structured_output`` constrains what may be generated.
    """

    request_id: RequestID
    index: int
    prompt: str | list[int] | None = None
    messages: list[TextGenerationRequestMessage] | None = None
    images: list[PreparedImage] = []
    tools: list[TextGenerationRequestTool] | None = None
    logprobs: int | None = None
    echo: bool = False
    sampling_params: SamplingParams = SamplingParams()
    structured_output: StructuredOutput | None = None
    cache_salt: str | None = None
    """Keeps this tenant's prefix-cache entries apart from everyone else's (vLLM's extension)."""
    chat_template_options: dict[str, Any] | None = None
    """Extra variables for the chat template (chat only), e.g. ``{"enable_thinking": False}``."""
    lora_name: str | None = None
    """The LoRA adapter to generate with (the ``model`` a client named); None: the base model."""

    @property
    def prompt_logprobs(self) -> int | None:
        """Log probabilities for the prompt's tokens: ``logprobs`` when echoing, else None."""
        return self.logprobs if self.echo else None


class TextContext(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A tokenized request: everything the scheduler and worker need to generate for it.

    Made by the API server (``PipelineTokenizer.new_context``), sent once to the scheduler, which
    forwards it to the worker in the request's first step; both cache it by ``request_id``.
    ``max_length`` bounds prompt plus output tokens (the model's context or the request's
    ``max_new_tokens``, whichever is smaller). ``eos_token_ids`` end generation unless
    ``sampling_params.ignore_eos``. Requests share cached KV blocks only when their
    ``cache_salt`` is equal (both None included).

    ``logprobs``: None returns no log probabilities; k >= 0 returns each generated token's log
    probability and the k most likely alternatives. ``prompt_logprobs`` does the same for the
    prompt tokens (completions ``echo`` with ``logprobs``); the first prompt token has none.
    ``structured_output`` constrains what may be generated. ``images`` (for a vision-language
    model) are in prompt order and do not overlap.

    ``generated_token_ids``: tokens this request already generated, when an API server submits
    it again to a scheduler that restarted (``api_server.resubmission``); they follow the prompt
    and count as its outputs (budget, penalties, ``min_tokens``, the seeded sampler's token
    index, the grammar replayed over them), and generation goes on after them. Empty for a new
    request.
    """

    request_id: RequestID
    prompt_token_ids: list[int]
    max_length: int
    eos_token_ids: list[int] = []
    sampling_params: SamplingParams = SamplingParams()
    cache_salt: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    images: list[ImageMetadata] = []
    generated_token_ids: list[int] = []
    lora_name: str | None = None
    """The LoRA adapter to generate with; None: the base model. The scheduler refuses a name
    it has not loaded."""
    lora_id: int = 0
    """The scheduler's id of that adapter, set when it admits the request (whatever an API
    server sends is replaced); 0 is the base model. Requests share cached KV blocks only when
    their ``lora_id`` is equal."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_new_tokens(self) -> int:
        """The most tokens this request may generate."""
        return self.max_length - len(self.prompt_token_ids)
