"""Structured output: grammars compiled by xgrammar, applied as token masks in the batched sampler.

``GrammarCompiler`` turns a request's ``StructuredOutput`` (JSON object, JSON schema, regex or
EBNF grammar) into a per-request ``RequestGrammar`` (an xgrammar ``GrammarMatcher``), compiling
each distinct (kind, spec) once. Each step, ``allowed_token_mask`` asks every matcher in the batch
for its next-token bitmask and unpacks them into one boolean mask with torch ops. Once a grammar
has ended, only end-of-sequence ids are allowed, so the request stops. xgrammar is imported on
first use: it takes seconds to import and most workers never need it.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from interfaces import StructuredOutput, TextContext

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_CACHE_SIZE = 256
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class RequestGrammar:
    """One request's grammar state: an xgrammar matcher advanced by each output token.

    ``eos_token_ids`` are the only tokens allowed once the grammar has ended.
    """

    def __init__(self, compiled: xgrammar.CompiledGrammar, eos_token_ids: Sequence[int]) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.eos_token_ids = list(eos_token_ids)

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: nothing but end-of-sequence may follow."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; ``RuntimeError`` if the grammar forbids it (a masking bug).

        After the grammar has ended the token is an end-of-sequence id and is not fed to it.
        """
        if self.is_terminated:
            return
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar rejected sampled token {token_id}")

    def replay(self, token_ids: Sequence[int]) -> None:
        """Advance over the outputs of a resumed request."""
        for token_id in token_ids:
            self.accept(token_id)


class GrammarCompiler:
    """Compiles structured-output specs for one model's tokenizer; owned by the ModelRunner.

    The tokenizer (transformers' AutoTokenizer from ``model_dir``) is loaded on first use, so a
    model directory without one works until a request asks for structured output.
    """

    def __init__(self, model_dir: Path, vocab_size: int, num_threads: int = 1) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._stop_token_ids: list[int] = []
        self._cache: OrderedDict[tuple[str, str | None], xgrammar.CompiledGrammar] = OrderedDict()

    def grammar_for(self, context: TextContext) -> RequestGrammar:
        """A fresh matcher for ``context.structured_output`` (which must be set).

        Raises ``ValueError`` naming the request when the spec is invalid.
        """
        structured = context.structured_output
        try:
            compiled = self.compile(structured)
        except ValueError as error:
            raise ValueError(f"request {context.request_id!r}: {error}") from None
        return RequestGrammar(compiled, context.eos_token_ids or self._stop_token_ids)

    def compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar for ``structured``, from the cache when seen before.

        Raises ``ValueError`` with xgrammar's reason for an invalid schema, regex or grammar.
        """
        key = (structured.kind, structured.spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        compiler = self._xgrammar_compiler()
        try:
            compiled = _compile(compiler, structured)
        except RuntimeError as error:
            reason = _XGRAMMAR_LOCATION.sub("", str(error).strip())
            raise ValueError(f"invalid {structured.kind} for structured output: {reason}") from None
        self._cache[key] = compiled
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except (OSError, ValueError) as error:
                raise ValueError(
                    f"structured output needs the model's tokenizer in {self.model_dir}: {error}"
                ) from None
            self._stop_token_ids = _stop_token_ids(tokenizer, self.model_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=self.num_threads)
        return self._compiler


def _compile(
    compiler: xgrammar.GrammarCompiler, structured: StructuredOutput
) -> xgrammar.CompiledGrammar:
    """Compile one spec; JSON comes out compact (no free whitespace), as ``json.dumps`` writes
    it, so a small model cannot wander off into endless blank lines."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec is None:
        raise ValueError(f"{kind} needs a spec")
    if kind == "json_schema":
        try:
            json.loads(spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"invalid json_schema for structured output: {error}") from None
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_grammar(spec)


def _stop_token_ids(tokenizer, model_dir: Path) -> list[int]:
    """The tokenizer's eos id and generation_config.json's ``eos_token_id`` (int or list)."""
    token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = model_dir / "generation_config.json"
    configured = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    token_ids += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(t for t in token_ids if isinstance(t, int)))


def allowed_token_mask(
    grammars: Sequence[RequestGrammar | None], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """The batch's structured-output mask: bool (num_rows, vocab_size), True = may be sampled.

    Rows without a grammar allow everything; rows whose grammar ended allow only their
    end-of-sequence ids. None when no row has a grammar.
    """
    if all(grammar is None for grammar in grammars):
        return None
    num_words = -(-vocab_size // 32)
    bitmask = torch.full((len(grammars), num_words), -1, dtype=torch.int32)  # all bits set
    eos_edits = []
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        if grammar.is_terminated:
            bitmask[row] = 0
            eos_edits += [(row, token_id) for token_id in grammar.eos_token_ids]
        else:
            grammar.matcher.fill_next_token_bitmask(bitmask, row)
    allowed = unpack_bitmask(bitmask.to(device), vocab_size)
    if eos_edits:
        rows_and_ids = torch.tensor(eos_edits, dtype=torch.int64, device=device)  # (num_edits, 2)
        allowed[rows_and_ids[:, 0], rows_and_ids[:, 1]] = True
    return allowed


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask (num_rows, ceil(vocab_size / 32)) as bool (num_rows, vocab_size):
    token i is allowed when bit i % 32 of word i // 32 is set."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (num_rows, num_words, 32)
    return bits.flatten(1)[:, :vocab_size].bool()  # (num_rows, vocab_size)
