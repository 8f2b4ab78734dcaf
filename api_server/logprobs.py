"""Log probabilities: from the worker's ``LogProbabilities`` to OpenAI's two response shapes.

The worker reports, per generated token, its log probability and a dict of the k most likely
token ids (``TextContext.logprobs`` = k); with ``prompt_logprobs`` the same for every prompt
token after the first. Here they become ``TokenLogprob`` entries, then either chat's
``logprobs.content`` (token, logprob, bytes, top_logprobs) or completions' legacy
``{tokens, token_logprobs, top_logprobs, text_offset}``. Token strings are each token decoded
alone (special tokens included); ``bytes`` are the token's raw bytes, so a token that holds half
of a UTF-8 character has text "\\ufffd" but its true bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer, decoders

from api_server.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from interfaces import LogProbabilities, TextGenerationOutput

MIN_LOGPROB = -9999.0
"""JSON has no -inf: impossible tokens (masked, or biased by -100) report this, as vLLM does."""


@dataclass(frozen=True)
class TokenLogprob:
    """One token of the text and how likely it was. ``logprob`` and ``top`` are None only for
    the first prompt token, which nothing predicts."""

    token_id: int
    logprob: float | None
    top: dict[int, float] | None


def output_logprobs(output: TextGenerationOutput) -> list[TokenLogprob]:
    """One entry per token of ``output`` that the worker reported log probabilities for."""
    values: list[float] = []
    tops: list[dict[int, float]] = []
    for step in output.log_probabilities or []:
        values += step.token_log_probabilities
        tops += step.top_log_probabilities
    return [
        TokenLogprob(token_id, value, top)
        for token_id, value, top in zip(output.tokens, values, tops, strict=False)
    ]


def prompt_logprobs(prompt_token_ids: list[int], reported: LogProbabilities) -> list[TokenLogprob]:
    """Entries for the whole prompt: the first token's are None, the rest from ``reported``."""
    entries = [TokenLogprob(prompt_token_ids[0], None, None)]
    pairs = zip(reported.token_log_probabilities, reported.top_log_probabilities, strict=False)
    for token_id, (value, top) in zip(prompt_token_ids[1:], pairs, strict=False):
        entries.append(TokenLogprob(token_id, value, top))
    return entries


class TokenTexts:
    """Each token id's text and raw bytes, for log probability responses (cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._added_ids = set(tokenizer.get_added_tokens_decoder())
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        piece = self._tokenizer.id_to_token(token_id) or ""
        byte_decoder = _byte_level_decoder()
        is_byte_level = self._byte_level and token_id not in self._added_ids
        if is_byte_level and piece and all(char in byte_decoder for char in piece):
            return [byte_decoder[char] for char in piece]
        return list(self.text(token_id).encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob], k: int, texts: TokenTexts) -> ChatLogprobs:
    """Chat's ``logprobs``: each token with exactly ``min(k, reported)`` alternatives."""
    content = []
    for entry in entries:
        top = [
            TopLogprob(token=texts.text(token_id), logprob=value, bytes=texts.bytes(token_id))
            for token_id, value in _most_likely(entry.top, k)
        ]
        content.append(
            ChatTokenLogprob(
                token=texts.text(entry.token_id),
                logprob=_clamped(entry.logprob),
                bytes=texts.bytes(entry.token_id),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: list[TokenLogprob], k: int, texts: TokenTexts, text_offset: int = 0
) -> CompletionLogprobs:
    """Completions' legacy ``logprobs``. ``top_logprobs`` maps token text to log probability for
    the k most likely tokens plus the chosen one (so up to k + 1 keys, as OpenAI documents).
    ``text_offset`` is each token's start when the token texts are laid end to end, beginning
    at ``text_offset`` (vLLM's convention)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry in entries:
        token = texts.text(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(None if entry.logprob is None else _clamped(entry.logprob))
        result.text_offset.append(text_offset)
        text_offset += len(token)
        if entry.top is None or entry.logprob is None:
            result.top_logprobs.append(None)
            continue
        top = {texts.text(token_id): value for token_id, value in _most_likely(entry.top, k)}
        top.setdefault(token, _clamped(entry.logprob))
        result.top_logprobs.append(top)
    return result


def _most_likely(top: dict[int, float] | None, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token id, clamped log probability) pairs, most likely first."""
    ranked = sorted((top or {}).items(), key=lambda item: (-_clamped(item[1]), item[0]))
    return [(token_id, _clamped(value)) for token_id, value in ranked[:k]]


def _clamped(value: float) -> float:
    return value if math.isfinite(value) and value >= MIN_LOGPROB else MIN_LOGPROB


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character → byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    characters = list(printable)
    num_extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + num_extra)
            num_extra += 1
    return {chr(character): byte for byte, character in zip(printable, characters, strict=True)}
