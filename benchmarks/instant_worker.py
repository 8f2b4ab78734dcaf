"""A worker without a model: answers every step at once, for benchmarks of the front end.

``InstantTokenGenerator`` stands in for ``ModelRunner`` behind the real ``WorkerServer``: it
keeps only token counts per request and returns one fixed token (``INSTANT_TOKEN_ID``, never an
end-of-sequence token) for every request a step brings to the end of its known tokens. What it
leaves out is the model and the checks of tests/support/fake_worker.py's
``FakeTokenGenerator``, so the processes in front of it (scheduler, API server, clients) are all
that a benchmark measures.

    python -m benchmarks.instant_worker --scheduler-addr ipc:///tmp/sy/backend --model DIR

Run it from the repository root (or with the root on PYTHONPATH), as ``-m`` needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import setproctitle

from interfaces import RequestID, TextGenerationOutput, envs
from interfaces.scheduler_to_worker import ScheduledStep
from interfaces.settings import add_flags, from_args
from interfaces.worker_to_scheduler import RequestFailure
from worker.model_files import model_name_for, resolve_model
from worker.settings import WorkerSettings

INSTANT_TOKEN_ID = 1000
"""``()`` in SmolLM2's vocabulary: one visible character pair per token, and not a special token."""

DEFAULT_NUM_KV_BLOCKS = 16384
"""Block ids cost the instant worker nothing; 16384 blocks of 16 tokens hold 64 requests of 4096."""

DEFAULT_VOCAB_SIZE = 49152
"""SmolLM2's, the default model's."""

PROCESS_TITLE = "switchyard-instant-worker"

INSTANT_WORKER_SETTINGS = ("model", "scheduler", "block_size")
"""The ``WorkerSettings`` fields whose flags (the worker's own) the instant worker takes."""

logger = logging.getLogger("instant_worker")


@dataclass(slots=True)
class InstantRequestState:
    num_tokens: int
    """Prompt plus output tokens the worker knows of."""
    num_computed_tokens: int


class InstantTokenGenerator:
    """``TokenGenerator[ScheduledStep]`` plus what ``WorkerServer`` reads from its runner.

    Follows the ScheduledStep contract as a real worker does: a new request arrives in full
    (its state replaces any earlier one), a cached one as a diff whose ``num_computed_tokens`` it
    takes as given, and ids in ``finished_request_ids`` are forgotten before the step runs. Block
    ids are ignored, since nothing is stored in them. Trusts the scheduler: a step naming a
    request it does not hold raises ``KeyError`` (``WorkerServer`` turns it into WorkerFailure).
    Called from one thread.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        num_kv_blocks: int = DEFAULT_NUM_KV_BLOCKS,
        block_size: int = 16,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        """Reported in the handshake: the scheduler refuses token ids outside it."""
        self.kv_layout = None
        """No KV cache to describe: the instant worker serves hybrid groups only."""
        self.states: dict[RequestID, InstantRequestState] = {}

    def next_token(self, step: ScheduledStep) -> dict[RequestID, TextGenerationOutput]:
        """Apply the step's diffs; return ``[INSTANT_TOKEN_ID]`` for each request that reaches
        the end of its known tokens."""
        for request_id in step.finished_request_ids:
            self.release(request_id)
        for new in step.new_requests:
            num_tokens = len(new.context.prompt_token_ids) + len(new.output_token_ids)
            self.states[new.context.request_id] = InstantRequestState(
                num_tokens, new.num_computed_tokens
            )
        for cached in step.cached_requests:
            self.states[cached.request_id].num_computed_tokens = cached.num_computed_tokens
        outputs = {}
        for request_id, num_scheduled in step.num_scheduled_tokens.items():
            state = self.states[request_id]
            state.num_computed_tokens += num_scheduled
            if state.num_computed_tokens == state.num_tokens:
                state.num_tokens += 1
                outputs[request_id] = TextGenerationOutput(request_id, [INSTANT_TOKEN_ID])
        return outputs

    def take_refusals(self) -> dict[RequestID, str]:
        """Requests refused in the last step: never any, since nothing is checked."""
        return {}

    def take_failures(self) -> dict[RequestID, RequestFailure]:
        """Requests whose sampling failed in the last step: never any, nothing is sampled."""
        return {}

    def take_deferred(self) -> list[RequestID]:
        """Requests that waited for a grammar in the last step: never any, none is compiled."""
        return []

    def release(self, request_id: RequestID) -> None:
        self.states.pop(request_id, None)

    def release_all(self) -> None:
        """Forget every request (the scheduler that sent them went away)."""
        self.states.clear()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.instant_worker", description=__doc__
    )
    add_flags(parser, WorkerSettings, INSTANT_WORKER_SETTINGS)
    parser.add_argument(
        "--num-kv-blocks",
        type=int,
        default=DEFAULT_NUM_KV_BLOCKS,
        help="KV cache blocks it reports (default: %(default)s)",
    )
    return parser.parse_args(argv)


def model_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def model_context_length(model_dir: Path) -> int:
    """``max_position_embeddings`` from the model's config.json (what the API server enforces)."""
    config = model_config(model_dir)
    return int(config["max_position_embeddings"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setproctitle.setproctitle(PROCESS_TITLE)
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s instant-worker: %(message)s"
    )
    settings = from_args(WorkerSettings, args, INSTANT_WORKER_SETTINGS)
    model_dir = resolve_model(settings.model.path)
    generator = InstantTokenGenerator(
        model_name=settings.model.served_model_name or model_name_for(settings.model.path),
        max_model_len=settings.model.max_model_len or model_context_length(model_dir),
        num_kv_blocks=args.num_kv_blocks,
        block_size=settings.block_size,
        vocab_size=model_config(model_dir)["vocab_size"],
    )
    # worker.server imports torch (through ModelRunner); importing it here, not at the top,
    # keeps InstantTokenGenerator usable where torch is not wanted (scheduler_bench, tests).
    from worker.server import WorkerServer

    return WorkerServer(generator, settings.scheduler.address).serve()


if __name__ == "__main__":
    sys.exit(main())
