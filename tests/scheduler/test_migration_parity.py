"""A request moved to a fresh worker after its group died gives the tokens it would have had:
the real placement and schedulers over two real ModelRunners (the default model) in one
process. Greedy, seeded sampling at temperature 0.8 with penalties, min_new_tokens and a
json_schema, and unseeded sampling at temperature 0.8 (with the seed the API server draws), each
moved after its first tokens, against the same requests undisturbed."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
from transformers import AutoTokenizer

from api_server.tokenizer import HuggingFaceTokenizer
from interfaces import (
    SamplingParams,
    SchedulerStatus,
    StructuredOutput,
    TextContext,
    TextGenerationRequest,
    TextGenerationRequestMessage,
)
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.worker_to_scheduler import WorkerOutput, WorkerReady
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.hybrid import HybridPlacement
from scheduler.worker_group import WorkerGroups
from tests.support.step_driver import context, small_runner
from worker.model_runner import ModelRunner

CLIENT = b"api-0"
MOVE_AFTER_TOKENS = 3
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def runners(default_model_dir: Path) -> dict[str, ModelRunner]:
    """Group a's worker, which dies, and group b's, which takes its requests (each with its
    own compiled grammars)."""
    return {name: small_runner(default_model_dir, 16 << 20) for name in ("a", "b")}


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    questions = {
        "greedy": "Name two planets.",
        "seeded": "Say something kind about trains.",
        "json": "Describe a person named Alice who is 30 years old as JSON.",
    }
    return {
        request_id: tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
        )
        for request_id, question in questions.items()
    }


@pytest.fixture(scope="module")
def unseeded(default_model_dir: Path) -> TextContext:
    """A request without a seed at temperature 0.8, its context built as the API server builds
    it: ``new_context`` draws its seed (each API server submits the context it built)."""
    params = SamplingParams(top_k=0, temperature=0.8, max_new_tokens=16, ignore_eos=True)
    message = TextGenerationRequestMessage("user", "Tell me about rivers.")
    request = TextGenerationRequest("unseeded", 0, messages=[message], sampling_params=params)
    tokenizer = HuggingFaceTokenizer(default_model_dir, max_model_len=256)
    built = asyncio.run(tokenizer.new_context(request))
    seed = built.sampling_params.seed
    assert seed is not None and built.sampling_params == msgspec.structs.replace(params, seed=seed)
    return built


def contexts(prompts: dict[str, list[int]], unseeded: TextContext, suffix: str):
    person = StructuredOutput("json_schema", json.dumps(SCHEMA))
    return [
        context("greedy" + suffix, prompts["greedy"], 16, ignore_eos=True),
        context(
            "seeded" + suffix,
            prompts["seeded"],
            16,
            top_k=0,
            temperature=0.8,
            seed=1234,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
            min_new_tokens=12,
        ),
        context("json" + suffix, prompts["json"], 40, structured_output=person),
        msgspec.structs.replace(unseeded, request_id="unseeded" + suffix),
    ]


class Groups:
    """A hybrid placement over some of ``runners``; ``run`` plays the server's loop."""

    def __init__(self, runners: dict[str, ModelRunner], names: list[str]) -> None:
        self.runners = runners
        self.placement = HybridPlacement(SchedulerConfig(8, 256), SchedulerCounters())
        self.workers = WorkerGroups()
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finals = {}
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        runner = self.runners[name]
        ready = WorkerReady(
            PROTOCOL_VERSION, "m", runner.num_kv_blocks, runner.block_size, 256, group=name
        )
        assert self.workers.register(name.encode(), ready).now_serving
        assert self.placement.add_group(self.workers.groups[name]) is None

    def take(self, results) -> None:
        for request_id, result in results.get(CLIENT, {}).items():
            if result.result is not None:
                self.tokens[request_id] += result.result.tokens
            if result.stop_stream:
                self.finals[request_id] = result

    def step(self) -> None:
        scheduled = self.placement.schedule(list(self.placement.groups))
        for name, step in scheduled:
            runner = self.runners[name]
            outputs = runner.next_token(step)
            deferred = runner.take_deferred()
            refusals, failures = runner.take_refusals(), runner.take_failures()
            output = WorkerOutput(step.step_id, outputs, refusals, failures, deferred)
            self.take(self.placement.update_from_output(name, output))
        for name in self.placement.groups:
            news = self.runners[name].grammar_news()
            if news is not None:
                self.take(self.placement.on_grammars(name, news))
        if not scheduled:
            time.sleep(0.01)  # a grammar compiles

    def run(self, request_ids: list[str], kill_after: int | None = None) -> dict[str, list[int]]:
        """Step until ``request_ids`` finished; with ``kill_after``, group a dies once each
        has that many tokens (then b, which serves too, takes them)."""
        deadline = time.monotonic() + 120
        while len(self.finals) < len(request_ids):
            assert time.monotonic() < deadline, "requests did not finish"
            self.step()
            if kill_after is not None and all(
                len(self.tokens[rid]) >= kill_after for rid in request_ids
            ):
                kill_after = None
                self.add("b")
                assert self.placement.remove_group("a", "the worker died") == {}
                moved = self.placement.groups["b"].scheduler.requests
                assert {rid: moved[rid].num_migrations for rid in request_ids} == dict.fromkeys(
                    request_ids, 1
                )
        assert {self.finals[rid].status for rid in request_ids} == {SchedulerStatus.COMPLETE}
        return dict(self.tokens)


def test_a_moved_request_gives_the_same_tokens_as_undisturbed(
    runners, prompts, unseeded, default_model_dir
):
    # Undisturbed on a first, so that a's grammar is compiled when the moved run starts there
    # (all of them then sample from the same step on), and b must compile it after the move.
    request_ids = [*prompts, "unseeded"]
    undisturbed = Groups(runners, ["a"])
    for request in contexts(prompts, unseeded, ""):
        assert undisturbed.placement.add_request(request, CLIENT) is None
    expected = undisturbed.run(request_ids)

    moved = Groups(runners, ["a"])  # every request starts on a
    for request in contexts(prompts, unseeded, "-moved"):
        assert moved.placement.add_request(request, CLIENT) is None
    ids = [f"{rid}-moved" for rid in request_ids]
    tokens = moved.run(ids, kill_after=MOVE_AFTER_TOKENS)

    assert {rid.removesuffix("-moved"): tokens[rid] for rid in ids} == expected
    assert len(expected["greedy"]) == len(expected["seeded"]) == len(expected["unseeded"]) == 16
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    document = tokenizer.decode(expected["json"], skip_special_tokens=True)
    assert set(json.loads(document)) == {"name", "age"}
