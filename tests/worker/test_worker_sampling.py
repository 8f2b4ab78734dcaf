"""Penalties, logit bias and min_new_tokens in the worker's batched sampler.

Unit tests use hand-made logits; end-to-end tests drive a ModelRunner on the tiny random Llama
with hand-built ScheduledSteps (``tests.support.step_driver.StepDriver``, also used by the
logprobs and structured-output tests).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from interfaces import SamplingParams
from interfaces.scheduler_to_worker import NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import RequestFailure
from tests.support.step_driver import EOS, DrivenRequest, StepDriver, context, small_runner
from worker.logits_processors import (
    RequestEdits,
    SamplingRow,
    build_logits_processors,
    edits_logits,
)
from worker.model_runner import ModelRunner
from worker.models import cpu_ops, tile_gemm
from worker.request_state import RequestState
from worker.sampler import NO_TOKEN, Sampler, SamplingBatch, check_supported, noise_key

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama_dir: Path) -> ModelRunner:
    return small_runner(tiny_llama_dir)


# Logits processors on hand-made logits

VOCAB = 6


def _row(prompt: list[int], outputs: list[int], **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [*prompt, *outputs], len(prompt))


def test_penalties_change_logits_exactly_as_the_formula_says():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3)
    rows = [
        _row([0, 1], [3, 3, 4], frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2),
        _row([0, 1], [3, 3, 4]),
        _row([0, 1], [5, 5], frequency_penalty=-1.0),
    ]
    processed = build_logits_processors(rows, VOCAB, CPU).apply(logits)
    # Row 0: repetition over prompt and outputs {0, 1, 3, 4} (2 -> 1, -1 -> -2, 3 -> 1.5,
    # -2 -> -4), then 0.5 * count (token 3 twice, token 4 once) and 0.25 for presence.
    assert processed.tolist() == [
        [1.0, -2.0, 0.5, 0.25, -4.75, 1.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 3.0],
    ]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3


def test_bias_and_blocked_tokens_edit_only_their_rows():
    logits = torch.zeros(2, VOCAB)
    rows = [
        _row([1], [], logit_bias={4: 3.5, 0: -1.0}),
        SamplingRow(SamplingParams(), [1], 1, blocked_token_ids=[2, 5]),
    ]
    processed = build_logits_processors(rows, VOCAB, CPU).apply(logits)
    inf = float("inf")
    assert processed.tolist() == [[-1.0, 0.0, 0.0, 0.0, 3.5, 0.0], [0.0, 0.0, -inf, 0.0, 0.0, -inf]]


def test_min_new_tokens_yields_to_a_grammar_that_allows_only_eos():
    logits = torch.zeros(2, VOCAB)
    allowed = torch.tensor([[False, False, True, False, False, False], [True] * VOCAB])
    rows = [SamplingRow(SamplingParams(), [1], 1, blocked_token_ids=[2])] * 2
    processed = build_logits_processors(rows, VOCAB, CPU, allowed).apply(logits)
    inf = float("inf")
    assert processed.tolist() == [[-inf, -inf, 0.0, -inf, -inf, -inf], [0, 0, -inf, 0, 0, 0]]


def test_rows_without_processors_are_not_copied():
    logits = torch.randn(2, VOCAB)
    processors = build_logits_processors([_row([1], [2]), _row([3], [])], VOCAB, CPU)
    assert processors.is_empty and processors.apply(logits) is logits


def _dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties over the whole vocabulary, as the worker applied them before they went
    sparse: the reference the sparse form must equal to the bit."""
    logits = logits.clone()
    for r, row in enumerate(rows):
        params = row.params
        if not row.has_penalties:
            continue
        counts = torch.zeros(logits.shape[1])
        for token in row.output_token_ids:
            counts[token] += 1
        seen = counts > 0
        if params.repetition_penalty != 1.0:
            seen[list(row.prompt_token_ids)] = True
        rep = torch.tensor(float(params.repetition_penalty))
        scaled = torch.where(logits[r] > 0, logits[r] / rep, logits[r] * rep)
        logits[r] = torch.where(seen, scaled, logits[r])
        logits[r] -= torch.tensor(float(params.frequency_penalty)) * counts
        logits[r] -= torch.tensor(float(params.presence_penalty)) * (counts > 0).float()
    return logits


def test_sparse_penalties_equal_the_whole_vocabulary_arithmetic():
    generator = torch.Generator().manual_seed(6)
    vocab = 300
    settings = [
        {},
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.7},
        {"presence_penalty": -0.4},
        {"repetition_penalty": 0.8, "frequency_penalty": -1.5, "presence_penalty": 2.0},
    ]
    rows = []
    for index in range(40):
        history = torch.randint(0, vocab, (60,), generator=generator).tolist()
        split = index % 30  # some rows with no outputs yet, some with repeats
        history[split + 1 : split + 5] = [history[split]] * 4
        rows.append(SamplingRow(SamplingParams(**settings[index % 5]), history, 60 - split))
    logits = 4 * torch.randn(40, vocab, generator=generator)
    processed = build_logits_processors(rows, vocab, CPU).apply(logits)
    assert torch.equal(processed, _dense_penalties(logits, rows))
    # The same with each request's prebuilt edits, which hold its prompt's distinct ids.
    prebuilt = [
        dataclasses.replace(
            row,
            edits=RequestEdits.build(row.params, [EOS], vocab, CPU, row.prompt_token_ids),
        )
        for row in rows
    ]
    assert torch.equal(build_logits_processors(prebuilt, vocab, CPU).apply(logits), processed)


def test_penalties_refuse_token_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="outside the vocabulary of 6"):
        build_logits_processors([_row([1], [6], frequency_penalty=0.5)], VOCAB, CPU)
    params = SamplingParams(repetition_penalty=1.5)
    edits = RequestEdits.build(params, [EOS], VOCAB, CPU, [1, 6])
    with pytest.raises(ValueError, match="outside the vocabulary of 6"):
        build_logits_processors([SamplingRow(params, [1, 6, 2], 2, edits=edits)], VOCAB, CPU)


def test_logit_bias_forces_a_token_greedy_and_sampled():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(logit_bias={7: 100.0}),
        SamplingParams(top_k=0, temperature=1.5, logit_bias={9: 100.0}),
        SamplingParams(top_k=0, temperature=1.0, top_p=0.9, seed=3, logit_bias={11: 100.0}),
    ]
    rows = [SamplingRow(p, [1], 1) for p in params]
    keys = [None, None, noise_key(5, 0)]
    batch = SamplingBatch.from_params(params, keys, 50, CPU, build_logits_processors(rows, 50, CPU))
    assert Sampler(CPU, seed=0)(logits, batch).tolist() == [7, 9, 11]


def test_logit_bias_outside_the_vocabulary_is_rejected(tiny_runner):
    check_supported(SamplingParams(logit_bias={49151: 1.0}), 49152)
    with pytest.raises(ValueError, match=r"outside the vocabulary of 49152: \[49152\]"):
        check_supported(SamplingParams(logit_bias={49152: 1.0, 3: 1.0}), 49152)
    bad = NewRequestData(context("bias", [5, 6], 4, logit_bias={60000: 5.0}), [0], 0)
    assert tiny_runner.next_token(ScheduledStep(0, [bad], num_scheduled_tokens={"bias": 2})) == {}
    refusals = tiny_runner.take_refusals()
    assert list(refusals) == ["bias"]
    assert refusals["bias"].startswith("logit_bias names token ids outside the vocabulary")
    assert tiny_runner.requests == {}


# End to end on the tiny model


def _tokens(requests: dict[str, DrivenRequest]) -> dict[str, list[int]]:
    return {request_id: r.output_token_ids for request_id, r in requests.items()}


def test_min_new_tokens_holds_back_eos_and_stop_ids(tiny_runner):
    forced = {EOS: 100.0, 7: 90.0}
    requests = [
        DrivenRequest(context("min", [11, 12, 13], 10, min_new_tokens=5, logit_bias=forced)),
        DrivenRequest(
            context(
                "stop",
                [11, 12, 13],
                10,
                min_new_tokens=3,
                stop_token_ids=[7],
                logit_bias={7: 100.0},
                ignore_eos=True,
            )
        ),
        DrivenRequest(context("ignore", [11, 12, 13], 2, ignore_eos=True, logit_bias=forced)),
    ]
    tokens = _tokens(StepDriver(tiny_runner).run(requests))
    assert tokens["min"] == [7, 7, 7, 7, 7, EOS]  # token 7 is the runner-up while EOS is held
    assert 7 not in tokens["stop"][:3] and tokens["stop"][3] == 7 and len(tokens["stop"]) == 4
    assert tokens["ignore"] == [EOS, EOS]


def test_penalties_run_end_to_end_and_change_greedy_output(tiny_runner):
    prompt = [21, 22, 23, 24]
    plain = DrivenRequest(context("plain", prompt, 12))
    penalised = DrivenRequest(
        context(
            "penalised",
            prompt,
            12,
            frequency_penalty=2.0,
            presence_penalty=2.0,
            repetition_penalty=1.5,
        )
    )
    tokens = _tokens(StepDriver(tiny_runner).run([plain, penalised]))
    assert tokens["plain"] != tokens["penalised"]
    assert len(set(tokens["penalised"])) == 12  # every repeat was penalised away


SAMPLED_WITH_PENALTIES = {
    "top_k": 0,
    "temperature": 1.0,
    "seed": 7,
    "frequency_penalty": 0.7,
    "presence_penalty": 0.3,
    "repetition_penalty": 1.2,
    "logit_bias": {100: 2.0},
}


def test_seeded_sampling_with_penalties_is_batch_independent(tiny_runner):
    prompt = [31, 32, 33, 34, 35]
    alone = StepDriver(tiny_runner).run(
        [DrivenRequest(context("s", prompt, 8, **SAMPLED_WITH_PENALTIES))]
    )
    alone_tokens = alone["s"].output_token_ids
    neighbours = [
        DrivenRequest(context(f"n{i}", [40 + i] * (3 + i), 8, top_k=0, frequency_penalty=1.0))
        for i in range(2)
    ]
    batch = [
        neighbours[0],
        DrivenRequest(context("s", prompt, 8, **SAMPLED_WITH_PENALTIES), [2, 3]),
        neighbours[1],
    ]
    assert StepDriver(tiny_runner, seed=1).run(batch)["s"].output_token_ids == alone_tokens
    resumed = DrivenRequest(
        context("s", prompt, 8, **SAMPLED_WITH_PENALTIES), resumed_token_ids=alone_tokens[:3]
    )
    assert StepDriver(tiny_runner, seed=2).run([resumed])["s"].output_token_ids == alone_tokens
    assert len(set(alone_tokens)) > 1


# One request never fails its batch


def test_non_finite_logits_are_never_sampled():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [nan] * VOCAB,  # nothing to sample
            [nan, 1.0, inf, 0.0, inf, nan],  # +inf ties: the first wins, never a NaN
            [nan, 0.0, nan, 0.0, -inf, 0.0],  # sampled: only the finite tokens
            [0.5, 3.0, 1.0, 0.0, 0.0, 0.0],  # temperature 1e-300 is greedy
            [-inf, nan, -inf, -inf, nan, -inf],  # every token forbidden: nothing to sample
        ]
    )
    params = [
        SamplingParams(),
        SamplingParams(),
        SamplingParams(top_k=0, temperature=1.0, top_p=0.9, min_p=0.1),
        SamplingParams(top_k=0, temperature=1e-300),
        SamplingParams(),
    ]
    batch = SamplingBatch.from_params(params, [None] * 5, VOCAB, CPU)
    assert batch.is_greedy.tolist() == [True, True, False, True, True]
    seen = set()
    for seed in range(40):
        tokens = Sampler(CPU, seed=seed)(logits, batch).tolist()
        assert tokens[:2] == [NO_TOKEN, 2] and tokens[3:] == [1, NO_TOKEN]
        seen.add(tokens[2])
    assert seen == {1, 3, 5}


def test_greedy_batches_take_the_same_tokens_from_the_cpu_kernel_as_from_torch(monkeypatch):
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [nan] * VOCAB,
            [nan, 1.0, inf, 0.0, inf, nan],
            [-inf, 0.0, nan, 2.0, -inf, 2.0],
            [0.5, 3.0, 1.0, 0.0, 0.0, 0.0],
        ]
    )
    logits = torch.cat([logits, torch.randn(60, VOCAB, generator=torch.Generator().manual_seed(1))])
    params = [SamplingParams(top_k=1)] * 2 + [SamplingParams(temperature=0.0)] * 62
    batch = SamplingBatch.from_params(params, [None] * 64, VOCAB, CPU)
    assert batch.all_greedy and cpu_ops.applies(logits)
    fast = Sampler(CPU, seed=0)(logits, batch)
    monkeypatch.setattr(cpu_ops, "applies", lambda tensor: False)
    assert fast.tolist() == Sampler(CPU, seed=0)(logits, batch).tolist()
    assert fast[:4].tolist() == [NO_TOKEN, 2, 3, 1]


@pytest.mark.parametrize(
    ("params", "edits"),
    [
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=0.0, ignore_eos=True, min_new_tokens=4), False),
        (SamplingParams(temperature=0.0, logit_bias={5: 2.0}), True),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), True),
        (SamplingParams(temperature=0.0, frequency_penalty=-0.5), True),
        (SamplingParams(temperature=0.0, repetition_penalty=1.3), True),
    ],
)
def test_rows_said_not_to_edit_their_logits_keep_them(params, edits):
    """``edits_logits`` (which rows may take the greedy head's token) says what
    ``build_logits_processors`` does, with and without a request's prebuilt edits."""
    for row_edits in (None, RequestEdits.build(params, [EOS], 16, CPU)):
        row = SamplingRow(params, [4, 5, 6, 5], 2, edits=row_edits)
        assert edits_logits(row) == edits
        logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(4))
        edited = build_logits_processors([row], 16, CPU).apply(logits)
        assert torch.equal(edited, logits) == (not edits)


def test_rows_with_min_new_tokens_still_to_reach_edit_their_logits():
    params = SamplingParams(temperature=0.0, min_new_tokens=4, stop_token_ids=[9])
    assert edits_logits(SamplingRow(params, [4, 5, 6], 2, blocked_token_ids=[9, 2]))


def test_tokens_known_before_sampling_join_the_sampled_ones_in_their_places(
    tiny_runner, monkeypatch
):
    """Where the model's greedy head picks some rows' tokens (``known``) and leaves others
    (``NEEDS_LOGITS``), every request gets the tokens and log probabilities of a run without it;
    here a stand-in head that takes the argmax of the float32 logits, on any machine."""
    model = tiny_runner.model.text_model
    calls: list[int] = []

    def greedy_tokens(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(len(hidden))
        tokens = model.logits(hidden).argmax(-1)
        tokens[::2] = tile_gemm.NEEDS_LOGITS  # every other row takes its logits after all
        return tokens

    prompt = [71, 72, 73, 74, 75]
    requests = [
        ("a", {"top_k": 1}),
        ("b", {"top_k": 1, "logprobs": 1}),
        ("c", {"top_k": 0, "temperature": 0.9, "seed": 3}),
        ("d", {"top_k": 1}),
        ("e", {"top_k": 1, "prompt_logprobs": 2}),
    ]

    def run() -> dict:
        return StepDriver(tiny_runner).run(
            [DrivenRequest(context(name, prompt[:3], 5, **fields)) for name, fields in requests]
        )

    without = run()
    monkeypatch.setattr(model, "greedy_head", object())
    monkeypatch.setattr(model, "greedy_tokens", greedy_tokens)
    with_known = run()
    assert calls and max(calls) == 3  # a, d and e
    for name, request in with_known.items():
        assert request.output_token_ids == without[name].output_token_ids, name
        assert [(o.log_probabilities, o.prompt_log_probabilities) for o in request.outputs] == [
            (o.log_probabilities, o.prompt_log_probabilities) for o in without[name].outputs
        ], name


def test_a_zero_repetition_penalty_stays_inside_the_grammar_mask():
    """``repetition_penalty: 1e-300`` is 0.0 in float32: seen positive logits become +inf."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0, 3.0, 0.5]] * 2)
    allowed = torch.tensor([[False, True, True, False, False, True]] * 2)
    params = [
        SamplingParams(repetition_penalty=1e-300),
        SamplingParams(top_k=0, temperature=1e-300, repetition_penalty=1e-300),
    ]
    rows = [SamplingRow(p, [0, 1, 4], 3) for p in params]  # tokens 0, 1 and 4 were seen
    processors = build_logits_processors(rows, VOCAB, CPU, allowed)
    batch = SamplingBatch.from_params(params, [None, None], VOCAB, CPU, processors)
    assert Sampler(CPU, seed=0)(logits, batch).tolist() == [1, 1]  # the allowed +inf token


def test_request_edits_match_the_edits_built_from_params():
    params = SamplingParams(
        logit_bias={4: 3.5, 0: -1.0}, min_new_tokens=2, stop_token_ids=[5, 1 << 40]
    )
    edits = RequestEdits.build(params, [EOS, 99], VOCAB, CPU)
    assert edits.bias_token_ids.tolist() == [4, 0] and edits.bias_values.tolist() == [3.5, -1.0]
    assert edits.min_tokens_blocked_ids.tolist() == [EOS, 5]  # ids outside the vocabulary: never
    logits = torch.zeros(2, VOCAB)
    blocked = edits.min_tokens_blocked_ids
    prebuilt = SamplingRow(params, [1], 1, blocked, edits)
    from_params = SamplingRow(params, [1], 1, [EOS, 5])
    processed = build_logits_processors([prebuilt, from_params], VOCAB, CPU).apply(logits)
    inf = float("inf")
    assert processed.tolist() == [[-1.0, 0.0, -inf, 0.0, 3.5, -inf]] * 2


def test_hostile_temperature_and_penalty_run_beside_innocent_requests(tiny_runner):
    prompt = [51, 52, 53, 54]
    alone = _tokens(StepDriver(tiny_runner).run([DrivenRequest(context("innocent", prompt, 8))]))
    hostile = [
        DrivenRequest(context("cold", [61, 62], 8, top_k=0, temperature=1e-300)),
        DrivenRequest(context("zero", [63, 64], 8, top_k=0, repetition_penalty=1e-300)),
    ]
    batch = [hostile[0], DrivenRequest(context("innocent", prompt, 8)), hostile[1]]
    tokens = _tokens(StepDriver(tiny_runner).run(batch))
    assert tokens["innocent"] == alone["innocent"]
    cold = _tokens(StepDriver(tiny_runner).run([DrivenRequest(context("cold", [61, 62], 8))]))
    assert tokens["cold"] == cold["cold"]  # greedy
    assert len(tokens["zero"]) == 8 and all(0 <= t < 49152 for t in tokens["zero"])


def test_a_request_whose_sampling_raises_fails_alone(tiny_runner, monkeypatch):
    prompt = [71, 72, 73]
    alone = _tokens(StepDriver(tiny_runner).run([DrivenRequest(context("good", prompt, 1))]))
    original = RequestState.sampling_row

    def sampling_row(state: RequestState) -> SamplingRow:
        if state.request_id == "bad":
            raise RuntimeError("boom")
        return original(state)

    monkeypatch.setattr(RequestState, "sampling_row", sampling_row)
    new = [
        NewRequestData(context("bad", [1, 2], 4, top_k=0), [0], 0),
        NewRequestData(context("good", prompt, 4), [1], 0),
    ]
    outputs = tiny_runner.next_token(ScheduledStep(0, new, [], {"bad": 2, "good": 3}))
    assert {request_id: o.tokens for request_id, o in outputs.items()} == alone
    assert tiny_runner.take_failures() == {"bad": RequestFailure("sampling failed: boom")}
    assert sorted(tiny_runner.requests) == ["bad", "good"]  # until the scheduler releases "bad"
    tiny_runner.next_token(ScheduledStep(1, finished_request_ids=["bad", "good"]))
    assert tiny_runner.requests == {}
