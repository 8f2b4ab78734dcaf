"""What the worker remembers about a request between steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from interfaces import RequestID, SamplingParams
from interfaces.scheduler_to_worker import NewRequestData
from worker.sampler import check_supported, token_seed


@dataclass
class RequestState:
    """A request's tokens and KV blocks as the worker knows them.

    Created from ``NewRequestData`` when the scheduler first sends (or resumes) a request, updated
    by each step's diff, dropped on ``finished_request_ids`` or ``ModelRunner.release``.
    ``token_ids`` is the prompt followed by every output token so far, including the ones this
    worker sampled; ``num_computed_tokens`` of them have keys/values in the cache.
    """

    request_id: RequestID
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None = None

    @classmethod
    def from_new_request(cls, new: NewRequestData, device: torch.device) -> RequestState:
        """State for a new request; ``ValueError`` for sampling settings the worker lacks."""
        context = new.context
        check_supported(context.sampling_params)
        seeded = context.sampling_params.seed is not None
        return cls(
            request_id=context.request_id,
            token_ids=[*context.prompt_token_ids, *new.output_token_ids],
            num_prompt_tokens=len(context.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=context.sampling_params,
            generator=torch.Generator(device) if seeded else None,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def next_token_generator(self) -> torch.Generator | None:
        """The generator for the next output token, seeded by its index; None when unseeded."""
        seed = self.sampling_params.seed
        if self.generator is None or seed is None:
            return None
        return self.generator.manual_seed(token_seed(seed, self.num_output_tokens))
