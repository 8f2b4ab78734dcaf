"""User logits processors (``worker.user_processors``): loaded by import path, applied to the
requests that name them, batched, isolated when they fail, one context per speculative row.

The example processors are defined here and loaded by their import path,
``tests.worker.test_user_processors:Name``; each records what it was given in ``CALLS``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interfaces import SamplingParams
from interfaces.sampling import LogitsProcessorCall
from interfaces.scheduler_to_worker import NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import RequestFailure
from tests.support.step_driver import DrivenRequest, StepDriver, context, small_runner
from worker.logits_processors import SamplingRow, build_logits_processors
from worker.model_runner import ModelRunner
from worker.request_sampler import RequestSampler
from worker.request_state import RequestState
from worker.sampler import Sampler
from worker.user_processors import (
    BatchProcessorInputs,
    ProcessorInputs,
    load_user_processors,
    user_processing,
)

CPU = torch.device("cpu")
HERE = "tests.worker.test_user_processors"
CALLS: list[tuple[str, object]] = []
"""(processor name, what it recorded) for every call, in order."""


def ban_token(inputs: ProcessorInputs) -> None:
    """Per request: the token ``args["token"]`` may not be sampled."""
    context = inputs.context
    CALLS.append(("ban_token", (context.request_id, context.output_token_ids, inputs.logits.shape)))
    inputs.logits[0, context.args["token"]] = float("-inf")


class ForceToken:
    """Batch: each row may only sample its request's ``args["token"]``."""

    batch_processor = True

    def __call__(self, inputs: BatchProcessorInputs) -> None:
        contexts = inputs.context_batch
        CALLS.append(
            ("ForceToken", ([c.request_id for c in contexts], inputs.logit_offsets.tolist()))
        )
        for row, row_context in enumerate(contexts):
            token = row_context.args["token"]
            kept = inputs.logits[row, token].clone()
            inputs.logits[row].fill_(float("-inf"))
            inputs.logits[row, token] = kept


def explode(inputs: ProcessorInputs) -> None:
    raise RuntimeError("kaboom")


def poison(inputs: ProcessorInputs) -> None:
    inputs.logits.fill_(float("nan"))


NOT_CALLABLE = 3


class BadFlag:
    batch_processor = "yes"

    def __call__(self, inputs) -> None:
        pass


PATHS = tuple(f"{HERE}:{name}" for name in ("ban_token", "ForceToken", "explode", "poison"))


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    return small_runner(tiny_llama_dir, logits_processors=PATHS)


@pytest.fixture(autouse=True)
def calls() -> list:
    CALLS.clear()
    return CALLS


def uses(*calls: tuple[str, dict | None]) -> list[LogitsProcessorCall]:
    return [LogitsProcessorCall(name, args) for name, args in calls]


def tokens_of(requests: dict[str, DrivenRequest]) -> dict[str, list[int]]:
    return {request_id: r.output_token_ids for request_id, r in requests.items()}


# Loading


def test_processors_load_by_import_path_in_order_with_their_form():
    loaded = load_user_processors(PATHS)
    assert [(p.name, p.is_batch) for p in loaded.values()] == [
        ("ban_token", False),
        ("ForceToken", True),
        ("explode", False),
        ("poison", False),
    ]
    assert loaded["ban_token"].function is ban_token
    assert isinstance(loaded["ForceToken"].function, ForceToken)  # a class: one instance


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz:Name", "--logits-processors no_such_module_xyz:Name: cannot import"),
        (f"{HERE}:missing", f"--logits-processors {HERE}:missing: module {HERE} has no missing"),
        (f"{HERE}:NOT_CALLABLE", f"{HERE}:NOT_CALLABLE: NOT_CALLABLE is not callable"),
        (f"{HERE}:BadFlag", "BadFlag.batch_processor must be a bool"),
        ("not a path", "'not a path' is not an import path pkg.module:Name"),
    ],
)
def test_a_bad_processor_path_is_a_start_up_error_naming_it(path, message):
    with pytest.raises(ValueError, match="^.*" + message.replace(".", r"\.").replace("(", r"\(")):
        load_user_processors([path])


def test_two_processors_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two processors are named 'ban_token'"):
        load_user_processors([f"{HERE}:ban_token", f"{HERE}:ban_token"])


def test_a_worker_with_a_bad_processor_does_not_start(tiny_llama_dir: Path):
    with pytest.raises(ValueError, match=f"--logits-processors {HERE}:missing: module"):
        small_runner(tiny_llama_dir, logits_processors=(f"{HERE}:ban_token", f"{HERE}:missing"))


# On hand-made logits


def test_processors_see_only_the_rows_that_asked_after_the_built_in_edits(calls):
    loaded = load_user_processors(PATHS[:2])
    rows = [
        SamplingRow(
            SamplingParams(logits_processors=uses(("ban_token", {"token": 1}))),
            [7, 8, 3],
            2,
            request_id="a",
        ),
        SamplingRow(SamplingParams(logit_bias={2: 1.0}), [7], 1, request_id="b"),
        SamplingRow(
            SamplingParams(
                logit_bias={0: 5.0},
                logits_processors=uses(("ForceToken", {"token": 0}), ("ban_token", {"token": 4})),
            ),
            [9],
            1,
            request_id="c",
        ),
    ]
    logits = torch.zeros(3, 6)
    processed = build_logits_processors(rows, 6, CPU, user_processors=loaded).apply(logits)
    inf = float("inf")
    assert processed.tolist() == [
        [0.0, -inf, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        [5.0, -inf, -inf, -inf, -inf, -inf],  # the bias before ForceToken kept token 0's 5.0
    ]
    assert logits.tolist() == [[0.0] * 6] * 3
    assert calls == [  # in load order: ban_token, then ForceToken
        ("ban_token", ("a", (3,), torch.Size([1, 6]))),
        ("ban_token", ("c", (), torch.Size([1, 6]))),
        ("ForceToken", (["c"], [0, 1])),
    ]


def test_each_speculative_row_sees_the_drafts_before_it(calls):
    """A request with drafts [5, 6] has three rows: after its outputs, after 5, after 5 and 6."""
    params = SamplingParams(logits_processors=uses(("ban_token", {"token": 0})))
    state = RequestState("spec", [1, 2, 3], 2, [0], 3, params, drafts=[5, 6])
    sampler = RequestSampler(Sampler(CPU, seed=0), 8, CPU, load_user_processors(PATHS[:1]))
    logits = torch.zeros(3, 8)
    logits[:, 0] = 10.0  # banned: each row's next likeliest is the id below
    logits[0, 5], logits[1, 6], logits[2, 7] = 2.0, 2.0, 2.0
    outputs = sampler.sample(logits, [state])
    assert outputs["spec"].tokens == [5, 6, 7]  # both drafts accepted, then token 7
    assert [recorded[1] for _, recorded in calls] == [(3,), (3, 5), (3, 5, 6)]


# In the worker, on the tiny model


def test_processors_apply_only_to_the_requests_that_name_them(runner, calls):
    prompt = [51, 52, 53, 54]
    alone = tokens_of(StepDriver(runner).run([DrivenRequest(context("plain", prompt, 4))]))
    banned = alone["plain"][0]
    force_77, force_9 = uses(("ForceToken", {"token": 77})), uses(("ForceToken", {"token": 9}))
    requests = [
        DrivenRequest(context("forced", [61, 62], 3, logits_processors=force_77)),
        DrivenRequest(context("plain", prompt, 4)),
        DrivenRequest(
            context("banned", prompt, 4, logits_processors=uses(("ban_token", {"token": banned})))
        ),
        DrivenRequest(context("forced2", [63], 2, logits_processors=force_9)),
    ]
    tokens = tokens_of(StepDriver(runner).run(requests))
    assert tokens["plain"] == alone["plain"]
    assert tokens["forced"] == [77, 77, 77]
    assert tokens["forced2"] == [9, 9]
    assert banned not in tokens["banned"] and len(tokens["banned"]) == 4
    batch_calls = [recorded for name, recorded in calls if name == "ForceToken"]
    assert batch_calls[0] == (["forced", "forced2"], [0, 1, 2])  # once per step, both rows
    assert len(batch_calls) == 3  # forced2 stops after 2 tokens
    ban_outputs = [recorded[1] for name, recorded in calls if name == "ban_token"]
    assert ban_outputs == [tuple(tokens["banned"][:i]) for i in range(4)]


def test_a_raising_or_nan_processor_fails_its_request_alone(runner):
    prompt = [71, 72, 73]
    alone = tokens_of(StepDriver(runner).run([DrivenRequest(context("good", prompt, 1))]))
    explode_it, poison_it = uses(("explode", None)), uses(("poison", None))
    new = [
        NewRequestData(context("bad", [1, 2], 4, logits_processors=explode_it), [0], 0),
        NewRequestData(context("good", prompt, 4), [1], 0),
        NewRequestData(context("nan", [3, 4], 4, logits_processors=poison_it), [2], 0),
    ]
    outputs = runner.next_token(ScheduledStep(0, new, [], {"bad": 2, "good": 3, "nan": 2}))
    assert {request_id: o.tokens for request_id, o in outputs.items()} == alone
    raised = "sampling failed: logits processor 'explode' raised RuntimeError('kaboom')"
    assert runner.take_failures() == {
        "bad": RequestFailure(raised),
        "nan": RequestFailure("no token could be sampled: every logit was -inf or NaN"),
    }
    runner.next_token(ScheduledStep(1, finished_request_ids=["bad", "good", "nan"]))
    assert runner.requests == {}
    # Without a raising processor in the step (no sampling row by row), it fails alone too.
    new = [
        NewRequestData(context("good", prompt, 4), [1], 0),
        NewRequestData(context("nan", [3, 4], 4, logits_processors=poison_it), [2], 0),
    ]
    outputs = runner.next_token(ScheduledStep(2, new, [], {"good": 3, "nan": 2}))
    assert {request_id: o.tokens for request_id, o in outputs.items()} == alone
    assert runner.take_failures() == {
        "nan": RequestFailure("no token could be sampled: every logit was -inf or NaN")
    }
    runner.next_token(ScheduledStep(3, finished_request_ids=["good", "nan"]))
    assert runner.requests == {}


def test_a_request_naming_a_processor_not_loaded_is_refused(runner):
    params = uses(("ban_token", {"token": 1}), ("nope", None))
    new = [NewRequestData(context("unknown", [1, 2], 4, logits_processors=params), [0], 0)]
    assert runner.next_token(ScheduledStep(0, new, [], {"unknown": 2})) == {}
    reason = "logits_processors names processors this worker does not load: ['nope']"
    assert runner.take_refusals() == {"unknown": reason}
    assert runner.take_failures() == {}
    assert runner.requests == {}  # released at once


def test_a_processor_cannot_change_its_request():
    """``args`` is read-only all the way down and ``sampling_params`` a copy: what a processor
    does to them never reaches the request's next step."""
    args = {"history": [1, {"seen": [2]}]}
    params = SamplingParams(
        stop_token_ids=[7], logits_processors=[LogitsProcessorCall("ban_token", args)]
    )
    loaded = load_user_processors([f"{HERE}:ban_token"])
    [row] = user_processing(loaded, [("r", params, [1, 2, 3], 2)]).contexts
    context = row["ban_token"]
    assert (context.prompt_token_ids, context.output_token_ids) == ((1, 2), (3,))
    with pytest.raises(TypeError):
        context.args["history"] = []
    with pytest.raises(AttributeError):
        context.args["history"][1]["seen"].append(3)  # a tuple
    context.sampling_params.stop_token_ids.append(99)
    assert params.stop_token_ids == [7]
    assert params.logits_processors[0].args == {"history": [1, {"seen": [2]}]}
