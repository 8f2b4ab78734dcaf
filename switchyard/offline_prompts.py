"""What the offline pipeline sends and what it reports, as lmdeploy's engine does.

``PromptBuilder`` turns a pipeline prompt (text, messages, or text with images) into a tokenized
``TextGenerationRequest``, as lmdeploy's ``_get_prompt_input`` does: with ``do_preprocess`` (the
default) text is one user turn and messages a conversation, rendered with the model's chat
template (generation prompt included) or a ``ChatTemplateConfig``'s pieces; without it, text goes
in as it is and messages as their contents run together (lmdeploy's empty ``BaseChatTemplate``).
``max_new_tokens`` is cut to the room the context leaves (lmdeploy's warning, not a refusal), and
the template's stop words apply where the request names none. On a stop, a response's
``token_ids`` end before the token that stopped generation (``reported_tokens``).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from api_server.config import MediaConfig
from api_server.text_stream import TextDelta
from api_server.tokenizer import HuggingFaceTokenizer
from interfaces import SamplingParams, TextGenerationRequest, TextGenerationRequestMessage
from interfaces.requests import PreparedImage
from switchyard.offline_images import check_image_count, image_prompt, prepare_images
from switchyard.offline_types import ChatTemplateConfig, GenerationConfig

logger = logging.getLogger("switchyard.offline")

Prompt = str | list[dict[str, Any]] | tuple[Any, Any]
"""A prompt: text, an OpenAI-style list of messages (``{"role": ..., "content": ...}``), or
lmdeploy's ``(text, image or [images])`` (``switchyard.offline_images``)."""
NO_TEMPLATE = ChatTemplateConfig("base")
"""lmdeploy's ``BaseChatTemplate()``, which renders prompts without ``do_preprocess``: text as it
is, messages as their contents one after the other."""


class ImageError(ValueError):
    """An image of one prompt cannot be used: that prompt fails, the others run."""


class PromptBuilder:
    """Requests for one pipeline's model; ``chat_template_config`` None renders prompts with
    the model's own chat template (text as it is when the model has none)."""

    def __init__(
        self,
        tokenizer: HuggingFaceTokenizer,
        chat_template_config: ChatTemplateConfig | None,
        media: MediaConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_config = chat_template_config
        self.media = media or MediaConfig()
        """Bounds on a prompt's images (count, bytes, pixels), as the API server has them."""
        self._template_tokenizer = self._find_template_tokenizer(tokenizer.model_dir)

    def request(
        self, prompt: Prompt, config: GenerationConfig, do_preprocess: bool = True
    ) -> tuple[TextGenerationRequest, int]:
        """The request for ``prompt`` with max_new_tokens cut to fit the context, and its number
        of prompt tokens. A prompt without images goes tokenized; one with images keeps its text
        or messages, its images loaded and preprocessed (``ImageError`` when one cannot be
        used, or the prompt has no place for them). CPU work: run it off the event loop."""
        images: list[PreparedImage] = []
        if isinstance(prompt, tuple):
            vision = self.tokenizer.vision
            if vision is None:
                raise ValueError(f"this model takes no images: {self.tokenizer.why_no_images}")
            text, inputs = image_prompt(prompt)
            try:
                check_image_count(len(inputs), vision, self.media, self.tokenizer.max_model_len)
                images = prepare_images(inputs, vision, self.media)
            except ValueError as error:
                raise ImageError(str(error)) from error
            prompt = _user_turn(text, len(images)) if do_preprocess else text
        request = TextGenerationRequest(
            request_id=f"pipeline-{uuid.uuid4().hex}",
            index=0,
            logprobs=config.logprobs,
            sampling_params=config.sampling_params(),
            structured_output=config.structured_output(),
            images=images,
            **self._prompt_field(prompt, do_preprocess),
        )
        try:
            token_ids = self.tokenizer.prompt_token_ids(request, len(images))
        except ValueError as error:
            if not images:
                raise
            # e.g. the text holds no image placeholder for each image: this prompt fails alone
            raise ImageError(str(error)) from error
        params = _fit_in_context(
            request.sampling_params, len(token_ids), self.tokenizer.max_model_len
        )
        if images:  # the engine client expands the image tokens itself
            return msgspec.structs.replace(request, sampling_params=params), len(token_ids)
        request = msgspec.structs.replace(
            request, prompt=token_ids, messages=None, sampling_params=params
        )
        return request, len(token_ids)

    def _find_template_tokenizer(self, model_dir: Path) -> HuggingFaceTokenizer | None:
        """The tokenizer whose chat template ``chat_template_config`` uses (that of its
        ``model_path``, else the pipeline's), or None where its pieces render prompts."""
        from worker.model_files import resolve_model

        template = self.chat_template_config
        if template is None:
            return None
        tokenizer = self.tokenizer
        template_dir = (
            model_dir if template.model_path is None else resolve_model(template.model_path)
        )
        if template_dir != model_dir:
            tokenizer = HuggingFaceTokenizer(template_dir, self.tokenizer.max_model_len)
        if template.model_name == "hf" and not tokenizer.has_chat_template:
            raise ValueError(
                "chat_template_config model_name 'hf' renders prompts with the chat template of "
                f"{tokenizer.model_dir}, which has none"
            )
        return tokenizer if template.uses_model_template(tokenizer.has_chat_template) else None

    def _prompt_field(
        self, prompt: str | list[dict[str, Any]], do_preprocess: bool
    ) -> dict[str, Any]:
        """The request's prompt. Without ``do_preprocess``: text as it is, messages' contents
        run together. Else through ``chat_template_config`` when given, else the model's chat
        template (text as one user turn; as it is when the model has no template)."""
        template = self.chat_template_config
        is_text = isinstance(prompt, str)
        if not do_preprocess:
            return {"prompt": prompt if is_text else NO_TEMPLATE.render(prompt)}
        if template is None:
            if is_text and not self.tokenizer.has_chat_template:
                return {"prompt": prompt}
            return {"messages": _messages(_user_turn(prompt, 0) if is_text else prompt)}
        if is_text and template.capability == "completion":
            return {"prompt": prompt}
        messages = _user_turn(prompt, 0) if is_text else prompt
        if self._template_tokenizer is None:
            # Encoded as text is, as lmdeploy encodes it: a BOS where the tokenizer adds one.
            return {"prompt": template.render(messages)}
        if self._template_tokenizer is self.tokenizer:
            return {"messages": _messages(messages)}
        text = self._template_tokenizer.render_messages(_messages(messages))
        return {"prompt": self.tokenizer.encode_now(text, add_special_tokens=False)}

    def with_stop_words(self, config: GenerationConfig) -> GenerationConfig:
        """``config`` with its stop words, or the chat template's when it names no stop words or
        stop token ids of its own (lmdeploy's rule). A stop word that is a special token becomes
        a stop token id, as lmdeploy turns every stop word into ids: with special tokens
        skipped, its text never reaches the output for a stop string to match."""
        template = self.chat_template_config
        words = config.stop_words
        if not (config.stop_words or config.stop_token_ids) and template is not None:
            words = template.stop_words
        if not words:
            return config
        special = self.tokenizer.special_token_texts
        token_ids = [self.tokenizer.backend.token_to_id(w) for w in words if w in special]
        return dataclasses.replace(
            config,
            stop_words=[word for word in words if word not in special] or None,
            stop_token_ids=[*(config.stop_token_ids or ()), *token_ids] or None,
        )

    def reported_tokens(
        self, delta: TextDelta, generated: list[int], config: GenerationConfig, stop_ids: set[int]
    ) -> list[int]:
        """The delta's tokens a response reports. On a stop, as lmdeploy: those before the token
        that stopped generation (a stop token, or the one that completed a stop word), that
        token too with ``include_stop_str_in_output``, nothing after it."""
        token_ids = list(delta.token_ids)
        if delta.finish_reason != "stop" or not token_ids:
            return token_ids
        keep = int(config.include_stop_str_in_output)
        count = _num_tokens_before_stop_word(
            self.tokenizer.backend, generated, token_ids, config.stop_words or [],
            config.skip_special_tokens,
        )  # fmt: skip
        if count is not None:
            return token_ids[: count + keep]
        if token_ids[-1] in stop_ids and not keep:
            return token_ids[:-1]
        return token_ids


def _user_turn(text: str, num_images: int) -> list[dict[str, Any]]:
    """A conversation of one user turn: ``text``, after its images (as LLaVA places them)."""
    if not num_images:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def _messages(messages: list[dict[str, Any]]) -> list[TextGenerationRequestMessage]:
    return [TextGenerationRequestMessage(**message) for message in messages]


def _fit_in_context(
    params: SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """``params`` with max_new_tokens cut to the room the prompt leaves in the context, as
    lmdeploy's engine cuts it (with its warning). A prompt that leaves no room is the
    pipeline's to answer."""
    room = max_model_len - num_prompt_tokens
    if params.max_new_tokens is None or room <= 0 or params.max_new_tokens <= room:
        return params
    logger.warning(
        "total sequence length (%d + %d) exceeds `session_len` (%d), `max_new_tokens` is "
        "truncated to %d", num_prompt_tokens, params.max_new_tokens, max_model_len, room,
    )  # fmt: skip
    min_new_tokens = min(params.min_new_tokens, room)
    return msgspec.structs.replace(params, max_new_tokens=room, min_new_tokens=min_new_tokens)


def _num_tokens_before_stop_word(
    tokenizer: Tokenizer,
    generated: list[int],
    new: list[int],
    stop_words: list[str],
    skip_special_tokens: bool,
) -> int | None:
    """How many of the ``new`` tokens come before the one that completed a stop word (None:
    none did). The text of ``generated`` has none, or generation would have stopped there."""
    for count in range(len(new)):
        text = tokenizer.decode(
            generated + new[: count + 1], skip_special_tokens=skip_special_tokens
        )
        if any(word and word in text for word in stop_words):
            return count
    return None
