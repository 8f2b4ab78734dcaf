"""How much structured-output work one request may ask of a worker: ``GrammarLimits``.

Compiling a grammar costs time superlinear in its size (a 1.1 MB choice list took 55 s), so a
spec is checked against ``max_spec_bytes`` and ``max_alternatives`` when its request arrives
(refused alone, an HTTP 400), compiles off the step for at most ``compile_timeout_s`` (then the
request fails alone, a 400 naming the limit) and compiled grammars are cached up to
``cache_bytes``. Following a grammar costs time every step too, and an ambiguous one costs more
with every token (seconds a token after a few dozen): a step waits at most ``mask_timeout_s``
for a request's next-token mask, and that request then fails alone (a 400 naming the limit);
a grammar whose masks each stay under it fails alone too once they take more than
``mask_time_per_token_s`` a token on average (with a burst of up to ``mask_timeout_s`` beyond).
No torch here: ``switchyard serve`` takes the same flags (declared on the fields,
``interfaces.settings``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from interfaces import StructuredOutput
from interfaces.settings import setting


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one worker's structured-output work; validated on construction.

    ``max_alternatives`` counts ``|`` in a regex or grammar, and ``enum``, ``anyOf`` and
    ``oneOf`` entries in a JSON schema.
    """

    compile_timeout_s: float = setting(
        30.0,
        "--grammar-compile-timeout",
        "fail a request (400) whose grammar takes longer than this to compile; other requests "
        "keep running meanwhile",
        metavar="SECONDS",
    )
    mask_timeout_s: float = setting(
        0.5,
        "--grammar-mask-timeout",
        "fail a request (400) whose grammar takes longer than this to say which tokens may come "
        "next (an ambiguous grammar can take seconds a token); the step waits for it no longer",
        metavar="SECONDS",
    )
    mask_time_per_token_s: float = setting(
        0.02,
        "--grammar-mask-time-per-token",
        "fail a request (400) whose grammar takes longer than this on average, a token, to say "
        "which tokens may come next (beyond a burst of one --grammar-mask-timeout); each step "
        "of its batch waits for it",
        metavar="SECONDS",
    )
    max_spec_bytes: int = setting(
        1 << 20,
        "--max-grammar-bytes",
        "refuse (400) a JSON schema, regex, grammar or choice list bigger than this",
    )
    max_alternatives: int = setting(
        20_000,
        "--max-grammar-alternatives",
        "refuse (400) a spec with more alternatives than this (choices, enum entries)",
    )
    cache_bytes: int = setting(
        512 << 20,
        "--grammar-cache-bytes",
        "memory for compiled grammars kept for reuse (least recently used go first)",
    )

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ValueError(
                f"grammar compile timeout must be positive, got {self.compile_timeout_s}"
            )
        if not (math.isfinite(self.mask_timeout_s) and self.mask_timeout_s > 0):
            raise ValueError(
                f"grammar mask timeout must be positive and finite, got {self.mask_timeout_s}"
            )
        if not (math.isfinite(self.mask_time_per_token_s) and self.mask_time_per_token_s > 0):
            raise ValueError(
                "grammar mask time per token must be positive and finite, got "
                f"{self.mask_time_per_token_s}"
            )
        for name in ("max_spec_bytes", "max_alternatives", "cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def mask_timeout_error(self) -> str:
        return (
            "the grammar for structured output took longer than the limit of "
            f"{self.mask_timeout_s:g} s (--grammar-mask-timeout) to give the tokens that may "
            "come next"
        )

    def mask_budget_error(self) -> str:
        return (
            "the grammar for structured output took longer than the limit of "
            f"{self.mask_time_per_token_s:g} s a token on average "
            "(--grammar-mask-time-per-token) to give the tokens that may come next"
        )

    def timeout_error(self, kind: str) -> str:
        return (
            f"compiling the {kind} for structured output took longer than the limit of "
            f"{self.compile_timeout_s:g} s (--grammar-compile-timeout)"
        )

    def check(self, structured: StructuredOutput) -> None:
        """Raise ``ValueError`` naming the limit when ``structured`` is too big to compile."""
        spec = structured.spec or ""
        num_bytes = len(spec.encode())
        if num_bytes > self.max_spec_bytes:
            raise ValueError(
                f"the {structured.kind} for structured output is {num_bytes} bytes, more than "
                f"the limit of {self.max_spec_bytes} bytes (--max-grammar-bytes)"
            )
        num_alternatives = count_alternatives(structured)
        if num_alternatives > self.max_alternatives:
            raise ValueError(
                f"the {structured.kind} for structured output has {num_alternatives} "
                f"alternatives, more than the limit of {self.max_alternatives} "
                "(--max-grammar-alternatives)"
            )


def count_alternatives(structured: StructuredOutput) -> int:
    """``|`` in a regex or grammar; entries of every ``enum``, ``anyOf`` and ``oneOf`` in a
    JSON schema (0 for one that does not parse: the compiler reports that)."""
    spec = structured.spec or ""
    if structured.kind != "json_schema":
        return spec.count("|")
    try:
        schema = json.loads(spec)
    except (ValueError, RecursionError):
        return 0
    count, stack = 0, [schema]
    while stack:  # iterative: a deeply nested schema must not exhaust the Python stack
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("enum", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    count += len(node[key])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count
