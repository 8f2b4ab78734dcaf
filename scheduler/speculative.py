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

TOKEN_BYTES = 4
"""Bytes per token in a ``SpecDecodingState``'s history (token ids are below 2^31)."""


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
        known = {item.name: item.type for item in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(
                f"--speculative-config has unknown fields {unknown}; known: {sorted(known)}"
            )
        for name, value in values.items():
            wanted = str if name == "method" else int
            if value is not None and (type(value) is not wanted):
                raise ValueError(f"--speculative-config field {name} must be {wanted.__name__}")
        return cls(**values)


@dataclass
class SpecDecodingState:
    """A request's speculative decoding state (MAX's ``SpecDecodingState``).

    ``draft_tokens_to_verify``: the drafts scheduled in the step in flight (empty when none).
    ``history``: its tokens, 4 little-endian bytes each, so that n-gram lookup is one
    ``bytearray.rfind`` in C rather than a Python loop; kept in step with the request's tokens.
    """

    draft_tokens_to_verify: list[int] = field(default_factory=list)
    history: bytearray = field(default_factory=bytearray)

    def extend(self, token_ids: list[int]) -> None:
        """Append tokens the request now holds (its context first, then each output)."""
        for token_id in token_ids:
            self.history += token_id.to_bytes(TOKEN_BYTES, "little")


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
        pattern = bytes(history[-width:])
        start = _aligned_rfind(history, pattern, end)
        if start >= 0:
            follow = history[start + width : start + width + limit * TOKEN_BYTES]
            return [
                int.from_bytes(follow[i : i + TOKEN_BYTES], "little")
                for i in range(0, len(follow), TOKEN_BYTES)
            ]
    return []


def _aligned_rfind(history: bytearray, pattern: bytes, end: int) -> int:
    """The start of the last occurrence of ``pattern`` in ``history[:end]`` that begins on a
    token boundary, or -1."""
    while True:
        start = history.rfind(pattern, 0, end)
        if start < 0 or start % TOKEN_BYTES == 0:
            return start
        end = start + len(pattern) - 1  # look further back, short of this misaligned match
