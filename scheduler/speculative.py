"""Speculative decoding by n-gram prompt lookup (vLLM's ``ngram`` method), on the scheduler.

Each step, a decoding request may carry draft tokens: if the last ``n`` tokens of its context
(prompt plus outputs) appeared earlier in it, for the largest ``n`` from ``prompt_lookup_max``
down to ``prompt_lookup_min``, the tokens that followed that earlier occurrence (the latest
one) are the drafts, up to ``num_speculative_tokens``. Text that repeats what came before
(editing or summarising a given text, code, quoting) gets drafts that are often right.

The worker computes the request's last token and its drafts in one pass and samples a token at
each of those positions exactly as it would one at a time (the same logits processing, the same
noise for a seeded request); it keeps the drafts up to the first that differs from the token
sampled in its place, and that sampled token: 1 to 1 + drafts tokens, token for token what
decoding without drafts gives. The scheduler then rewinds ``num_computed_tokens`` past the
rejected drafts (their KV slots are overwritten later; their blocks are never hashed into the
prefix cache, which looks at known tokens only).

Requests that follow a grammar get no drafts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from interfaces.scheduler_to_worker import MAX_DRAFT_TOKENS

TOKEN_BYTES = 5
"""Bytes per token in a ``SpecDecodingState``'s history: 4 bits, then 7 bits in each of four
bytes, the first byte marked by its high bit, so that a byte pattern of whole tokens can only
match on a token boundary (``rfind`` never returns a match straddling two tokens)."""
MAX_TOKEN_ID = (1 << 32) - 1
"""The largest token id the history holds (the scheduler fails an output with a larger one)."""


def encode_token(token_id: int) -> bytes:
    """``token_id`` (0 to ``MAX_TOKEN_ID``) as ``TOKEN_BYTES`` history bytes."""
    return bytes(
        (
            0x80 | token_id >> 28,
            token_id >> 21 & 0x7F,
            token_id >> 14 & 0x7F,
            token_id >> 7 & 0x7F,
            token_id & 0x7F,
        )
    )


def decode_token(encoded: bytes | bytearray) -> int:
    """The token id of ``TOKEN_BYTES`` history bytes (``encode_token``'s inverse)."""
    first, *rest = encoded
    token_id = first & 0x0F
    for byte in rest:
        token_id = token_id << 7 | byte
    return token_id


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``: vLLM's field names and defaults for the ``ngram`` method."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    """The most draft tokens per request per step."""
    prompt_lookup_max: int | None = None
    """The longest n-gram looked up (default: ``prompt_lookup_min``, else 5)."""
    prompt_lookup_min: int | None = None
    """The shortest n-gram looked up (default: ``prompt_lookup_max``, else 5)."""

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method {self.method!r} is not supported (only ngram)")
        if not 1 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be 1 to {MAX_DRAFT_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        low = self.prompt_lookup_min or self.prompt_lookup_max or 5
        high = self.prompt_lookup_max or self.prompt_lookup_min or 5
        if not 1 <= low <= high <= 64:
            raise ValueError(
                f"prompt_lookup_min ({low}) and prompt_lookup_max ({high}) must satisfy "
                "1 <= min <= max <= 64"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config of a JSON object such as ``{"method": "ngram", "num_speculative_tokens":
        4, "prompt_lookup_max": 4}``; ``ValueError`` that says what is wrong."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = [item.name for item in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"--speculative-config has unknown fields {unknown}; known: {known}")
        for name, value in values.items():
            wanted = str if name == "method" else int
            if type(value) is not wanted:
                raise ValueError(f"--speculative-config field {name} must be {wanted.__name__}")
            if wanted is int and value < 1:
                raise ValueError(f"--speculative-config field {name} must be at least 1")
        return cls(**values)


@dataclass
class SpecDecodingState:
    """A request's speculative decoding state (MAX's ``SpecDecodingState``).

    ``draft_tokens_to_verify``: the drafts scheduled in the step in flight (empty when none).
    ``history``: its tokens, ``TOKEN_BYTES`` each (``encode_token``), so that n-gram lookup is
    one ``bytearray.rfind`` in C rather than a Python loop; kept in step with its tokens.
    """

    draft_tokens_to_verify: list[int] = field(default_factory=list)
    history: bytearray = field(default_factory=bytearray)

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens the request now holds (its context first, then each output)."""
        self.history += b"".join(map(encode_token, token_ids))


def propose_drafts(state: SpecDecodingState, config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to ``limit`` draft tokens for the request whose tokens ``state.history`` holds:
    what followed the latest earlier occurrence of its longest matching suffix n-gram, or
    nothing when no n-gram of ``prompt_lookup_min`` tokens or more recurs."""
    history = state.history
    if limit < 1:
        return []
    end = len(history) - TOKEN_BYTES  # an occurrence must end before the last token
    for n in range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1):
        width = n * TOKEN_BYTES
        if width > end:
            continue
        start = history.rfind(history[-width:], 0, end)  # on a token boundary: TOKEN_BYTES
        if start >= 0:
            follow = history[start + width : start + width + limit * TOKEN_BYTES]
            return [
                decode_token(follow[i : i + TOKEN_BYTES])
                for i in range(0, len(follow), TOKEN_BYTES)
            ]
    return []
