"""The API server's ``PipelineTokenizer``: a Hugging Face tokenizer directory, read without torch.

Text goes through ``tokenizers.Tokenizer`` (tokenizer.json); chat prompts through the chat template
in tokenizer_config.json or chat_template.jinja, rendered by ``api_server.chat_template``. For a
vision-language model (``api_server.vision``) each image token of the prompt is expanded to the
positions its image fills, and the images' pixels go into shared memory with the context.

Rendering and tokenizing a prompt is CPU work proportional to its size, so ``new_context``,
``encode`` and ``decode`` do it in a small pool of threads (``run_in_thread``, which the server
also uses for its other costly checks), never on the event loop; tokenizing goes through
``encode_batch_fast``, which releases the GIL, so the loop serves other requests meanwhile, and
skips the character offsets nothing here reads (a fifth less time than ``encode_batch``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from tokenizers import Tokenizer

from api_server.chat_messages import is_about_tools, template_message, template_tool
from api_server.chat_template import (
    render_chat_template,
    render_fallback_prompt,
    template_renders_tools,
)
from api_server.config import generation_eos_token_ids, read_json
from api_server.image_segments import ImageSegments
from api_server.tool_parsers import hermes_messages
from api_server.vision import UnsupportedVisionModel, VisionModel
from interfaces import (
    SamplingParams,
    TextContext,
    TextGenerationRequest,
    TextGenerationRequestMessage,
)

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
NUM_PREPARE_THREADS = 2
"""Requests prepared (checked, rendered, tokenized) at once by one API server; more wait their
turn. Few, so that pure-Python checks leave the event loop its share of the GIL."""
logger = logging.getLogger(__name__)
T = TypeVar("T")


class HuggingFaceTokenizer:
    """Implements ``interfaces.PipelineTokenizer`` for one model directory.

    ``max_model_len`` bounds prompt plus output tokens; a prompt that leaves no room for output
    raises ``ValueError`` (the HTTP layer answers 400). Safe to share between requests: it holds
    no per-request state.
    """

    def __init__(self, model_dir: Path, max_model_len: int) -> None:
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.backend = _load_backend(self.model_dir / "tokenizer.json")
        config = read_json(self.model_dir / "tokenizer_config.json")
        self.special_tokens = _special_tokens(config)
        self.chat_templates = _chat_templates(self.model_dir, config)
        self.eos_token_ids = self._find_eos_token_ids()
        added_tokens = self.backend.get_added_tokens_decoder().values()
        self._special_token_texts = frozenset(t.content for t in added_tokens if t.special)
        self.vision, self._vision_problem = _load_vision(self.model_dir)
        self._threads = ThreadPoolExecutor(NUM_PREPARE_THREADS, thread_name_prefix="prepare")

    async def run_in_thread(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in the prepare threads, off the event loop; its exception, if
        any, is raised here. Cancelling the caller leaves the call to finish in its thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(function, *args))

    @property
    def eos(self) -> int:
        """The end-of-sequence token id (the tokenizer's eos token, else generation config's)."""
        return self.eos_token_ids[0]

    @property
    def expects_content_wrapping(self) -> bool:
        """Message content reaches the template as a plain string, never as typed parts."""
        return False

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_texts(self) -> frozenset[str]:
        """The text of every special token (what ``skip_special_tokens`` drops from output)."""
        return self._special_token_texts

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    @property
    def why_no_images(self) -> str | None:
        """Why this model takes no images (for the 400 that refuses them); None if it does."""
        if self.vision is not None:
            return None
        return self._vision_problem or "it is not a vision-language model"

    async def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``prompt`` (tokenized in a prepare thread); ``ValueError`` if they
        exceed ``max_model_len``."""
        token_ids = await self.run_in_thread(self.encode_now, prompt, add_special_tokens)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, "
                f"but the text has {len(token_ids)} tokens."
            )
        return token_ids

    def encode_now(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text`` with no length check (synchronous; ``encode_batch_fast``,
        unlike ``encode``, lets other threads run meanwhile)."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    async def decode(self, encoded: list[int], **kwargs: Any) -> str:
        """Text for ``encoded`` (decoded in a prepare thread); ``skip_special_tokens`` (default
        False) as in transformers."""
        skip_special_tokens = kwargs.get("skip_special_tokens", False)
        return await self.run_in_thread(self.backend.decode, encoded, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (dicts with role and string content), ending with the
        assistant's turn. Without a chat template: mlx_lm.server's role-prefix format. Tools,
        earlier tool calls and tool results go through the template when it renders tools,
        else they are written into the messages in the Hermes format (``hermes_messages``)."""
        source = self._template_source(tools)
        renders_tools = source is not None and template_renders_tools(source)
        if not renders_tools and (tools or any(is_about_tools(m) for m in messages)):
            messages, tools = hermes_messages(messages, tools), None
        if source is None:
            return render_fallback_prompt(messages)
        return render_chat_template(source, messages, self.special_tokens, tools, options)

    def _template_source(self, tools: list[dict[str, Any]] | None) -> str | None:
        """The template for this conversation: "tool_use" when there are tools and the model
        has one, else the default; None when the model has no template."""
        if not self.chat_templates:
            return None
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_templates.get("default") or next(iter(self.chat_templates.values()))

    async def new_context(
        self, request: TextGenerationRequest, images: ImageSegments | None = None
    ) -> TextContext:
        """Tokenize ``request`` (chat template for messages) and bound its output length; the
        context carries the request's log probabilities, constraint and images, and its
        sampling params with a seed: the request's own, else one drawn here (``with_seed``).

        ``max_length`` is prompt tokens + max_new_tokens, or max_model_len when max_new_tokens is
        not set. Raises ``ValueError`` for an empty prompt, token ids outside the vocabulary, a
        prompt that leaves no room, or prompt + max_new_tokens beyond max_model_len (as OpenAI
        and vLLM refuse it, rather than quietly generating less than asked).

        ``request.images`` (a vision-language model only) each go into a shared-memory segment
        of their own, created last, once every check has passed, and owned by ``images``, which
        the caller closes (required when the request has images). The prompt is rendered and
        tokenized in a prepare thread.
        """
        if request.images and images is None:
            raise TypeError("a request with images needs an ImageSegments to own them")
        num_images = len(request.images)
        prompt_token_ids = await self.run_in_thread(self.prompt_token_ids, request, num_images)
        num_prompt_tokens = len(prompt_token_ids)
        self._check_prompt_length(num_prompt_tokens)
        max_new_tokens = request.sampling_params.max_new_tokens
        max_length = self.max_model_len
        if max_new_tokens is not None:
            max_length = num_prompt_tokens + max_new_tokens
            if max_length > self.max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {max_length} tokens ({num_prompt_tokens} in the "
                    f"prompt, {max_new_tokens} for the completion). Please reduce the length "
                    "of the prompt or of the completion."
                )
        image_metadata = []
        if request.images:  # only a vision model's prompt got this far with images
            spans = self.vision.image_spans(prompt_token_ids)
            image_metadata = images.create(request.images, spans)
        return TextContext(
            request_id=request.request_id,
            prompt_token_ids=prompt_token_ids,
            max_length=max_length,
            eos_token_ids=list(self.eos_token_ids),
            sampling_params=with_seed(request.sampling_params),
            cache_salt=request.cache_salt,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            structured_output=request.structured_output,
            images=image_metadata,
            lora_name=request.lora_name,
        )

    def render_messages(
        self,
        messages: list[TextGenerationRequestMessage],
        tools: list[dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation; ``ValueError`` if the template refuses it."""
        dicts = [template_message(message) for message in messages]
        return self.apply_chat_template(dicts, tools, options)

    def prompt_token_ids(self, request: TextGenerationRequest, num_images: int = 0) -> list[int]:
        """The prompt's token ids (chat template applied; for a vision-language model, each
        image token expanded to its image's positions); ``ValueError`` if it is empty, has ids
        outside the vocabulary, the template refuses the conversation, or the prompt does not
        hold exactly ``num_images`` image tokens. No length check."""
        if request.messages is not None:
            tools = [template_tool(tool) for tool in request.tools] if request.tools else None
            prompt = self.render_messages(request.messages, tools, request.chat_template_options)
            token_ids = self.encode_now(prompt, add_special_tokens=False)
        elif isinstance(request.prompt, str):
            token_ids = self.encode_now(request.prompt, add_special_tokens=True)
        elif isinstance(request.prompt, list):
            token_ids = self._checked_token_ids(request.prompt)
        else:
            raise ValueError("a request needs either messages or a prompt")
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        if self.vision is not None:
            return self.vision.expand_image_tokens(token_ids, num_images)
        if num_images:
            raise ValueError(f"this model takes no images: {self.why_no_images}")
        return token_ids

    def _checked_token_ids(self, token_ids: list[int], what: str = "prompt") -> list[int]:
        vocab_size = self.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"{what} token id {token_id} is outside the vocabulary [0, {vocab_size})"
                )
        return list(token_ids)

    def decode_checked(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text for ``token_ids``; ``ValueError`` for an id outside the vocabulary."""
        self._checked_token_ids(token_ids, what="the")
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _check_prompt_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {num_prompt_tokens} tokens, leaving no room for the completion. "
                "Shorten the prompt or the conversation."
            )

    def _find_eos_token_ids(self) -> list[int]:
        token_ids: list[int] = []
        eos_text = self.special_tokens.get("eos_token")
        eos_id = self.backend.token_to_id(eos_text) if eos_text else None
        if eos_id is not None:
            token_ids.append(eos_id)
        token_ids += generation_eos_token_ids(self.model_dir)
        token_ids = list(dict.fromkeys(token_ids))
        if not token_ids:
            raise ValueError(f"{self.model_dir} names no end-of-sequence token")
        return token_ids


def with_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed: its own, else 63 fresh bits from the operating system's source
    (``secrets``). Each request still gets fresh randomness, but the worker draws its tokens
    from (seed, token index) alone, so a request moved to another worker after a fault (or
    preempted) continues with the tokens it would have had. The seed stays inside Switchyard:
    no response carries it."""
    if params.seed is not None:
        return params
    return msgspec.structs.replace(params, seed=secrets.randbits(63))


def _load_vision(model_dir: Path) -> tuple[VisionModel | None, str | None]:
    """The model's vision side (None for a text model), or None and why images are refused."""
    try:
        return VisionModel.load(model_dir), None
    except UnsupportedVisionModel as error:
        problem = f"its image input is not supported: {error}"
        logger.warning("%s takes images, but they will be refused: %s", model_dir, problem)
        return None, problem


def _load_backend(path: Path) -> Tokenizer:
    if not path.is_file():
        raise ValueError(f"{path} does not exist: the model directory needs a tokenizer.json")
    backend = Tokenizer.from_file(str(path))
    backend.no_truncation()
    backend.no_padding()
    return backend


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """``bos_token`` etc. as strings (tokenizer_config may hold them as AddedToken dicts)."""
    tokens = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """Templates by name ("default", "tool_use", ...); chat_template.jinja wins over the config."""
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return {"default": template_file.read_text(encoding="utf-8")}
    template = config.get("chat_template")
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):
        return {item["name"]: item["template"] for item in template if isinstance(item, dict)}
    return {}
