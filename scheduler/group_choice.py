"""Which worker group a new request goes to, by ``SchedulerConfig.placement``.

The scheduler owns every group's block pool, so it knows exactly, with no lag, how many of a
prompt's tokens each group holds in its prefix cache (routers in front of separate engines,
such as llm-d's, SGLang's or Dynamo's, estimate this or follow KV events behind the fact).
``cache-aware`` placement uses that:

1. **Balance first.** Only groups whose load (requests waiting or running) is at most
   ``BALANCE_RATIO`` times the least loaded group's, or ``BALANCE_SLACK`` requests above it,
   are candidates. A hot shared prefix cached on one group would otherwise draw every request
   there; with the bound, the next request goes to another group, which caches the prefix
   too, and the groups' loads stay within the bound of each other.
2. **Then least cost.** Among the candidates, the request goes where it costs the fewest
   tokens (``placement_cost``): the work before its first token there
   (``work_before_first_token``: the tokens computed ahead of it, i.e. queued requests'
   tokens not cached when they were queued, prompt chunks still to run and one token per
   running request per step meanwhile, then its own tokens not cached there, and, where the
   pool lacks free blocks for them, the tokens whose blocks must first be freed), plus its
   own uncached tokens once more: the work it adds to that group, which every request queued
   there after it waits for too. So a request follows its cache unless the queue ahead of it
   there is longer than twice what the cache saves. None counts as cached for a request that
   wants prompt logprobs (cached positions give none). Ties go to the less loaded group.

A follow-up turn of a chat thus returns to the group that holds its history as long as that
group is not overloaded, and requests with nothing cached go where the least work is queued.
``least-loaded`` keeps the older policy for comparison: the group with the fewest requests.

Decode groups of a disaggregated deployment compute no prompt: with ``cache-aware`` they are
chosen by load within the same balance bound, then by free blocks; with ``least-loaded`` by
free blocks alone (as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from interfaces import TextContext
from scheduler.admission import num_context_tokens
from scheduler.block_hash import BlockHash, extend_block_hashes
from scheduler.block_manager import cdiv
from scheduler.config import PlacementPolicy
from scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from scheduler.placement import ServedGroup

BALANCE_RATIO = 1.25
"""A candidate group holds at most this many times the requests of the least loaded group..."""
BALANCE_SLACK = 2
"""...or at most this many requests more (so that a few requests may follow their cache)."""


def context_block_hashes(context: TextContext, block_size: int) -> list[BlockHash]:
    """The hashes of the full blocks of ``context``'s tokens (its prompt and any tokens it
    generated already), as a pool of ``block_size`` blocks caches them."""
    token_ids = [*context.prompt_token_ids, *context.generated_token_ids]
    hashes: list[BlockHash] = []
    extend_block_hashes(
        hashes, token_ids, block_size, context.cache_salt, context.images, context.lora_id
    )
    return hashes


def work_before_first_token(
    scheduler: Scheduler, num_tokens: int, block_hashes: list[BlockHash]
) -> int:
    """Tokens ``scheduler``'s group computes before a request of ``num_tokens`` tokens, whose
    blocks hash to ``block_hashes``, produces its first token there (see the module): in
    steps of ``max_num_batched_tokens``, each of which also decodes one token for every
    request running."""
    block_manager = scheduler.block_manager
    num_cached = block_manager.num_cached_tokens(block_hashes, num_tokens)
    num_new = num_tokens - num_cached
    work = scheduler.num_tokens_ahead() + num_new
    num_steps = cdiv(work, scheduler.config.max_num_batched_tokens)
    num_short = block_manager.num_blocks_for(num_new) - block_manager.num_free_blocks
    return work + len(scheduler.running) * num_steps + max(num_short, 0) * block_manager.block_size


def placement_cost(scheduler: Scheduler, num_tokens: int, block_hashes: list[BlockHash]) -> int:
    """What running the request on ``scheduler``'s group costs, in tokens: the work before its
    first token there (``work_before_first_token``: what it waits for) plus its own tokens not
    cached there once more (the work it adds to that group, which every request queued there
    after it waits for too)."""
    num_cached = scheduler.block_manager.num_cached_tokens(block_hashes, num_tokens)
    return work_before_first_token(scheduler, num_tokens, block_hashes) + num_tokens - num_cached


def balanced(groups: Sequence[ServedGroup]) -> list[ServedGroup]:
    """The groups within the balance bound of the least loaded one (see the module)."""
    least = min(group.load for group in groups)
    bound = max(least * BALANCE_RATIO, least + BALANCE_SLACK)
    return [group for group in groups if group.load <= bound]


def choose_group(
    groups: Sequence[ServedGroup], context: TextContext, policy: PlacementPolicy
) -> ServedGroup:
    """Where ``context`` computes its prompt: one of ``groups`` (hybrid or prefill groups,
    at least one, of one block size) by ``policy``."""
    if policy is PlacementPolicy.LEAST_LOADED or len(groups) == 1:
        return min(groups, key=lambda group: group.load)
    candidates = balanced(groups)
    num_tokens = num_context_tokens(context)
    block_hashes: list[BlockHash] = []
    if context.prompt_logprobs is None:  # cached positions give no logprobs: none is used
        block_hashes = context_block_hashes(context, candidates[0].ready.block_size)
    return min(
        candidates,
        key=lambda group: (
            placement_cost(group.scheduler, num_tokens, block_hashes),
            group.load,
        ),
    )


def choose_decode_group(groups: Sequence[ServedGroup], policy: PlacementPolicy) -> ServedGroup:
    """Which of ``groups`` (decode groups that can reserve a request's blocks now, at least
    one) decodes it, by ``policy``."""
    candidates = balanced(groups) if policy is PlacementPolicy.CACHE_AWARE else groups
    return max(candidates, key=lambda group: group.scheduler.block_manager.num_free_blocks)
