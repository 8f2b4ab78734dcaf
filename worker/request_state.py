"""What the worker remembers about a request between steps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from interfaces import LogProbabilities, RequestID, SamplingParams
from interfaces.scheduler_to_worker import NewRequestData
from worker.grammar_compiler import PendingGrammar
from worker.images import RequestImage
from worker.logits_processors import RequestEdits, SamplingRow, edits_logits
from worker.logprobs import as_log_probabilities
from worker.sampler import noise_key
from worker.structured_output import RequestGrammar


@dataclass
class PromptLogprobs:
    """Prompt log probabilities gathered over a request's prefill chunks, until sent.

    Entry i is for prompt token i + 1 given the tokens before it: (its log probability, the
    ``num_top`` likeliest tokens there with theirs).
    """

    num_top: int
    entries: list[tuple[float, dict[int, float]]] = field(default_factory=list)


@dataclass
class RequestState:
    """A request's tokens and KV blocks as the worker knows them.

    Created from ``NewRequestData`` when the scheduler first sends (or resumes) a request, updated
    by each step's diff, dropped on ``finished_request_ids`` or ``ModelRunner.release``.
    ``token_ids`` is the prompt followed by every output token so far, including the ones this
    worker sampled; ``num_computed_tokens`` of them have keys/values in the cache.
    ``logprobs`` is the context's (None: no log probabilities for sampled tokens).
    ``prompt_logprobs`` is None unless prompt log probabilities are still to be sent: they go out
    once, with the first sampled token, so a request resumed with outputs has none.
    ``grammar`` holds the structured-output matcher, advanced by every output token; while it
    compiles, ``pending_grammar`` is set instead (``attach_grammar`` swaps them).
    ``edits`` are its logit bias and min-new-tokens ids as tensors, built once.
    ``refusal`` is why the worker will not serve the request (set on arrival): its scheduled
    tokens are computed so shared KV blocks stay valid, but it is never sampled.
    ``images`` are a vision-language request's images, their features kept once computed
    (``worker.images``).
    ``drafts`` are the draft tokens to verify in the step being run (speculative decoding:
    ``scheduler.speculative``), empty otherwise: they follow ``token_ids`` in that step's input.
    ``lora_id`` is the LoRA adapter it runs with (``worker.lora``); 0 is the base model.
    """

    request_id: RequestID
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: PromptLogprobs | None = None
    grammar: RequestGrammar | None = None
    pending_grammar: PendingGrammar | None = None
    edits: RequestEdits | None = None
    refusal: str | None = None
    images: list[RequestImage] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    lora_id: int = 0

    @classmethod
    def from_new_request(
        cls,
        new: NewRequestData,
        device: torch.device,
        vocab_size: int,
        grammar: PendingGrammar | None = None,
        images: list[RequestImage] | None = None,
    ) -> RequestState:
        """State for a new (or resumed) request; ``grammar`` is its compiling grammar
        (``attach_grammar`` replays it over the outputs); ``images`` come from
        ``worker.images.read_images``.

        Raises ``ValueError`` if prompt log probabilities are due but the scheduler starts the
        request past its first token (a prefix-cache hit): those positions are never computed.
        """
        context = new.context
        prompt_logprobs = _prompt_logprobs_due(new)
        params = context.sampling_params
        return cls(
            request_id=context.request_id,
            token_ids=[*context.prompt_token_ids, *new.output_token_ids],
            num_prompt_tokens=len(context.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=context.sampling_params,
            eos_token_ids=list(context.eos_token_ids),
            logprobs=context.logprobs,
            prompt_logprobs=prompt_logprobs,
            pending_grammar=grammar,
            edits=RequestEdits.build(
                params, context.eos_token_ids, vocab_size, device, context.prompt_token_ids
            ),
            images=images or [],
            lora_id=new.context.lora_id,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def at_draft(self, index: int) -> RequestState:
        """This request as it will be once its first ``index`` drafts are accepted: the
        sampling position after draft ``index`` sees them as outputs (penalties, min tokens,
        the seeded noise of that output index). A view for sampling only."""
        return dataclasses.replace(
            self, token_ids=[*self.token_ids, *self.drafts[:index]], drafts=[]
        )

    def next_noise_key(self) -> int | None:
        """The sampler's noise key for the next output token: ``noise_key`` of the seed and
        the token's index among the outputs, so the same wherever and whenever it is sampled;
        None when unseeded."""
        seed = self.sampling_params.seed
        return None if seed is None else noise_key(seed, self.num_output_tokens)

    def sampling_row(self) -> SamplingRow:
        """This request as one row of the next sampling batch."""
        return SamplingRow(
            self.sampling_params,
            self.token_ids,
            self.num_prompt_tokens,
            self.blocked_token_ids(),
            self.edits,
            self.request_id,
        )

    def picks_argmax(self) -> bool:
        """Whether its next token is the first index of its largest raw logit and nothing
        else of its logits is needed: greedy, no grammar (compiled or compiling), nothing that
        edits logits, no log probabilities. Such a row may take its token from the model's
        greedy head instead of the logits."""
        return (
            self.sampling_params.is_greedy
            and self.logprobs is None
            and self.grammar is None
            and self.pending_grammar is None
            and not edits_logits(self.sampling_row())
        )

    def blocked_token_ids(self) -> torch.Tensor | list[int]:
        """Ids the next token may not be: end-of-sequence (unless ``ignore_eos``) and stop ids
        while fewer than ``min_new_tokens`` were generated (a grammar that allows nothing else
        overrides this; see ``LogitsProcessors``)."""
        if self.num_output_tokens >= self.sampling_params.min_new_tokens or self.edits is None:
            return []
        return self.edits.min_tokens_blocked_ids

    def attach_grammar(self, grammar: RequestGrammar) -> None:
        """Follow ``grammar``, the compiled ``pending_grammar``, replayed over the outputs so
        far (``RuntimeError`` if it rejects one)."""
        self.pending_grammar = None
        grammar.replay(self.token_ids[self.num_prompt_tokens :])
        self.grammar = grammar

    def append_output(self, token_id: int) -> None:
        """Record a sampled token and advance the grammar (``RuntimeError`` if it rejects it)."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.token_ids.append(token_id)

    def take_prompt_logprobs(self) -> LogProbabilities | None:
        """The prompt log probabilities, once, when all were gathered; None otherwise."""
        gathered, self.prompt_logprobs = self.prompt_logprobs, None
        if gathered is None:
            return None
        if len(gathered.entries) != self.num_prompt_tokens - 1:
            raise RuntimeError(
                f"request {self.request_id!r}: {len(gathered.entries)} prompt log probabilities "
                f"gathered for {self.num_prompt_tokens} prompt tokens"
            )
        return as_log_probabilities(gathered.entries)


def _prompt_logprobs_due(new: NewRequestData) -> PromptLogprobs | None:
    """An empty accumulator when prompt log probabilities are still to be sent, else None."""
    context = new.context
    if context.prompt_logprobs is None or new.output_token_ids:
        return None
    if new.num_computed_tokens > 0:
        raise ValueError(
            f"request {context.request_id!r} asks for prompt_logprobs but starts at token "
            f"{new.num_computed_tokens}; the scheduler must compute its whole prompt (no "
            "prefix-cache hits for such requests)"
        )
    return PromptLogprobs(context.prompt_logprobs)
