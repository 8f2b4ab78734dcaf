"""The step's token budget: ``--max-num-batched-tokens`` when given, else what each worker
group suggests in its handshake (``WorkerReady.step_tokens``: 512 on a CPU, 8192 on CUDA)."""

from __future__ import annotations

import pytest

from interfaces.embeddings import EmbeddingsContext
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.worker_to_scheduler import (
    CPU_STEP_TOKENS,
    CUDA_STEP_TOKENS,
    WorkerReady,
)
from scheduler.config import KVCacheConfig, SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.embeddings import Embeddings
from scheduler.hybrid import HybridPlacement
from scheduler.scheduler import Scheduler
from scheduler.worker_group import WorkerGroups
from tests.support.scheduler_sockets import ctx


def served_budgets(config: SchedulerConfig, suggestions: dict[str, int]) -> dict[str, int]:
    """Each group's scheduler's budget once groups suggesting ``suggestions`` serve."""
    placement, workers = HybridPlacement(config, SchedulerCounters()), WorkerGroups()
    for name, step_tokens in suggestions.items():
        ready = WorkerReady(PROTOCOL_VERSION, "m", 64, 4, 256, group=name, step_tokens=step_tokens)
        assert workers.register(name.encode(), ready).now_serving
        assert placement.add_group(workers.groups[name]) is None
    return {
        name: served.scheduler.config.max_num_batched_tokens
        for name, served in placement.groups.items()
    }


def test_each_group_takes_the_budget_it_suggests_unless_one_is_given():
    suggestions = {"gpu": CUDA_STEP_TOKENS, "cpu": CPU_STEP_TOKENS, "old": 0}
    assert served_budgets(SchedulerConfig(), suggestions) == {
        "gpu": 8192,
        "cpu": 512,
        "old": 512,  # a worker that does not say: the CPU's
    }
    given = SchedulerConfig(max_num_batched_tokens=100)
    assert served_budgets(given, suggestions) == {"gpu": 100, "cpu": 100, "old": 100}


def test_a_step_holds_the_groups_budget():
    """A GPU group's step prefills 40 prompts of 128 tokens at once; a CPU group's takes 4."""
    for step_tokens, expected in ((CUDA_STEP_TOKENS, 40 * 128), (CPU_STEP_TOKENS, 512)):
        config = SchedulerConfig().with_step_tokens(step_tokens)
        scheduler = Scheduler(config, KVCacheConfig(4096, 16, 1024))
        for i in range(40):
            assert scheduler.add_request(ctx(f"r{i}", [i + 1] * 128), b"api") is None
        assert scheduler.schedule().total_num_scheduled_tokens == expected


def test_an_embedding_group_batches_up_to_its_own_budget():
    embeddings = Embeddings(SchedulerConfig())
    embeddings.add_group("gpu", CUDA_STEP_TOKENS)
    embeddings.add_group("cpu", 0)
    embeddings.submit(b"api", [EmbeddingsContext(f"e{i}", [1] * 256) for i in range(40)])
    steps = dict(embeddings.schedule(["cpu", "gpu"]))
    assert len(steps["cpu"].contexts) == 2  # 512 tokens
    assert len(steps["gpu"].contexts) == 32  # 8192 tokens


@pytest.mark.parametrize("budget", [0, -1])
def test_a_budget_below_one_token_is_refused(budget):
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 1"):
        SchedulerConfig(max_num_batched_tokens=budget)
