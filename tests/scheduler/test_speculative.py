"""Speculative decoding on the scheduler: the config, n-gram drafts, and what a step's verified
drafts do to a request (tokens, computed tokens, blocks, counters), beside requests without."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from interfaces import (
    GenerationStatus,
    LogProbabilities,
    SchedulerStatus,
    StructuredOutput,
    TextGenerationOutput,
)
from interfaces.worker_to_scheduler import WorkerOutput
from scheduler.scheduler import MALFORMED_OUTPUT
from scheduler.speculative import (
    MAX_TOKEN_ID,
    TOKEN_BYTES,
    SpecDecodingState,
    SpeculativeConfig,
    decode_token,
    encode_token,
    propose_drafts,
)
from tests.support.scheduler_steps import CLIENT, EOS, context, make_scheduler

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'  # noqa: E501


def drafts_for(tokens, limit=3, low=2, high=3):
    state = SpecDecodingState()
    state.extend(tokens)
    config = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=low, prompt_lookup_max=high
    )
    return propose_drafts(state, config, limit)


# -- the config ----------------------------------------------------------------------------------


def test_config_defaults_follow_vllm():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.parse('{"num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 4, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ngram", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"method": "eagle"}', "only ngram"),
        ('{"num_speculative_tokens": 0}', "must be at least 1"),
        ('{"num_speculative_tokens": 17}', "must be 1 to 16"),
        ('{"num_speculative_tokens": "4"}', "must be int"),
        ('{"num_speculative_tokens": true}', "must be int"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "1 <= min <= max <= 64"),
        ('{"prompt_lookup_max": 65}', "1 <= min <= max <= 64"),
        ('{"model": "draft"}', "unknown fields ['model']"),
        ('{"num_speculative_tokens": null}', "must be int"),
        ('{"prompt_lookup_min": 0}', "must be at least 1"),
    ],
)
def test_bad_configs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse(text)


def test_a_bad_config_is_refused_with_the_scheduler_config():
    with pytest.raises(ValueError, match="only ngram"):
        make_scheduler(speculative_config='{"method": "medusa"}')


# -- drafts --------------------------------------------------------------------------------------


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    # ... 7 8 9 occurs twice before the end; the later one is followed by 4 5 6
    assert drafts_for([7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]) == [4, 5, 6]
    # the 3-gram 1 8 9 never recurs; the 2-gram 8 9 does
    assert drafts_for([8, 9, 5, 5, 1, 8, 9]) == [5, 5, 1]


def test_drafts_stop_at_the_limit_and_at_the_end():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert drafts_for(tokens, limit=2) == [3, 4]
    assert drafts_for([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert drafts_for([5, 1, 2, 1, 2]) == [1, 2]  # follows the match up to the last token
    assert drafts_for(tokens, limit=0) == []


def test_no_drafts_without_a_recurring_ngram():
    assert drafts_for([1, 2, 3, 4, 5, 6]) == []
    assert drafts_for([3, 1, 2, 9, 2]) == []  # a lone token recurs; n >= 2 does not
    assert drafts_for([4]) == []


def test_matches_never_straddle_token_boundaries():
    # 0x02010000, 0 is the byte string 00 00 01 02 00 00 00 00; so are the last two bytes of 5
    # (05 00 00 00), 513 (01 02 00 00) and the first two of 0x70000 (00 00 07 00): a later,
    # misaligned match that only whole-token matching skips.
    a, b = 0x02010000, 0
    tokens = [a, b, 9, 5, 513, 0x70000, a, b]
    four_bytes = b"".join(token.to_bytes(4, "little") for token in tokens)
    assert four_bytes.rfind(four_bytes[-8:], 0, 7 * 4) == 14  # what plain bytes would match
    assert drafts_for(tokens, low=2, high=2) == [9, 5, 513]


def test_token_ids_round_trip_through_the_history():
    for token_id in (0, 1, 127, 128, 49151, 1 << 28, MAX_TOKEN_ID):
        assert decode_token(encode_token(token_id)) == token_id
        assert len(encode_token(token_id)) == TOKEN_BYTES


# -- a scheduler with drafts ---------------------------------------------------------------------

REPEATING = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]  # then 12 13 10 ... is a good guess


def output(request_id, tokens, logprobs=None):
    return TextGenerationOutput(request_id, list(tokens), log_probabilities=logprobs)


def start(scheduler, *requests):
    """Admit ``requests`` [(id, prompt, max_new_tokens, sampling)], prefill each and give it
    its first token, 12 (which the repeating prompt predicts)."""
    for request_id, prompt, max_new_tokens, sampling in requests:
        request = context(request_id, prompt, max_new_tokens, **sampling)
        assert scheduler.add_request(request, CLIENT) is None
    step = scheduler.schedule()
    assert step.spec_token_ids == {}  # a request's first token never comes with drafts
    outputs = {request_id: output(request_id, [12]) for request_id in step.num_scheduled_tokens}
    scheduler.update_from_output(WorkerOutput(step.step_id, outputs))


def test_a_decode_carries_drafts_and_keeps_the_accepted_ones():
    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    start(scheduler, ("a", REPEATING, 20, {}))
    request = scheduler.requests["a"]
    assert (request.num_tokens, request.num_computed_tokens) == (11, 10)

    step = scheduler.schedule()
    assert step.spec_token_ids == {"a": [13, 10, 11]}
    assert step.num_scheduled_tokens == {"a": 4}  # its last token and three drafts
    assert request.num_computed_tokens == 14
    # The blocks hold the drafts' slots, but only known tokens are hashed into the cache.
    assert len(request.block_ids) == 4
    assert request.num_cached_blocks == 2  # 11 known tokens: two full blocks of 4

    # Two drafts accepted, the third rejected: the worker sampled 99 in its place.
    results = scheduler.update_from_output(
        WorkerOutput(step.step_id, {"a": output("a", [13, 10, 99])})
    )
    assert results[CLIENT]["a"].result.tokens == [13, 10, 99]
    assert request.output_token_ids == [12, 13, 10, 99]
    assert (request.num_tokens, request.num_computed_tokens) == (14, 13)
    counters = scheduler.counters
    assert (counters.spec_decode_num_drafts, counters.spec_decode_num_draft_tokens) == (1, 3)
    assert counters.spec_decode_num_accepted_tokens == 2
    assert counters.spec_decode_num_accepted_tokens_per_pos[:4] == [1, 1, 0, 0]
    scheduler.check_integrity()

    step = scheduler.schedule()  # ... 10 99: no 2-gram recurs, so no drafts
    assert step.spec_token_ids == {}
    assert step.num_scheduled_tokens == {"a": 1}
    stats = scheduler.stats()
    assert stats.spec_decode_num_accepted_tokens_per_pos_total[:2] == [1, 1]


def test_drafts_fit_the_tokens_left_and_the_budget():
    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    start(scheduler, ("a", REPEATING, 3, {}))  # two tokens left: one draft and the one after
    step = scheduler.schedule()
    assert step.spec_token_ids == {"a": [13]}

    scheduler = make_scheduler(block_size=4, budget=2, speculative_config=NGRAM)
    start(scheduler, ("a", REPEATING[:2], 20, {}))
    for token in REPEATING[2:]:  # feed the prompt's pattern as outputs, one per step
        step = scheduler.schedule()
        scheduler.update_from_output(WorkerOutput(step.step_id, {"a": output("a", [token])}))
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"a": 2}  # the budget of 2 leaves room for one draft
    assert len(step.spec_token_ids["a"]) == 1


def test_no_drafts_for_a_grammar_or_without_the_config():
    scheduler = make_scheduler(block_size=4)
    start(scheduler, ("a", REPEATING, 20, {}))
    assert scheduler.schedule().spec_token_ids == {}

    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    regex = StructuredOutput("regex", "[0-9]+")
    scheduler.add_request(replace(context("a", REPEATING, 20), structured_output=regex), CLIENT)
    step = scheduler.schedule()
    scheduler.update_from_output(WorkerOutput(step.step_id, {"a": output("a", [12])}))
    assert scheduler.schedule().spec_token_ids == {}


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    start(scheduler, ("a", REPEATING, 20, {"stop_token_ids": [10]}))
    step = scheduler.schedule()
    assert step.spec_token_ids == {"a": [13, 10, 11]}
    logprobs = [
        LogProbabilities([-0.1, -0.2, -0.3, -0.4], [{13: -0.1}, {10: -0.2}, {11: -0.3}, {5: -0.4}])
    ]
    produced = output("a", [13, 10, 11, 5], logprobs)  # all accepted, but 10 stops it
    result = scheduler.update_from_output(WorkerOutput(step.step_id, {"a": produced}))
    result = result[CLIENT]["a"]
    assert result.status is SchedulerStatus.COMPLETE
    assert result.result.tokens == [13, 10]
    assert result.result.final_status is GenerationStatus.END_OF_SEQUENCE
    assert result.result.log_probabilities == [
        LogProbabilities([-0.1, -0.2], [{13: -0.1}, {10: -0.2}])
    ]
    assert "a" not in scheduler.requests
    scheduler.check_integrity()


def test_more_tokens_than_drafts_fail_that_request_alone():
    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    start(scheduler, ("bad", REPEATING, 20, {}), ("innocent", REPEATING, 20, {"seed": 1}))
    step = scheduler.schedule()
    assert step.spec_token_ids == {"bad": [13, 10, 11], "innocent": [13, 10, 11]}
    outputs = {
        "bad": output("bad", [13, 10, 11, 12, 13]),  # five tokens for three drafts
        "innocent": output("innocent", [13, 10, 11, 12]),
    }
    results = scheduler.update_from_output(WorkerOutput(step.step_id, outputs))[CLIENT]
    assert results["bad"].status is SchedulerStatus.CANCELLED
    assert results["bad"].error == MALFORMED_OUTPUT
    assert results["innocent"].result.tokens == [13, 10, 11, 12]
    innocent = scheduler.requests["innocent"]
    assert (innocent.num_tokens, innocent.num_computed_tokens) == (15, 14)
    scheduler.check_integrity()
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"innocent"}


def test_a_request_moved_to_another_group_drops_its_drafts_in_flight():
    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    start(scheduler, ("a", REPEATING, 20, {}))
    scheduler.schedule()
    [request] = scheduler.take_requests()
    assert request.spec.draft_tokens_to_verify == []
    assert request.num_computed_tokens == 0
    assert EOS not in request.all_token_ids


def test_drafts_never_preempt_another_request_for_their_blocks():
    # 7 blocks of 4: "a" and "b" hold 3 each after their first token (11 tokens and a slot).
    scheduler = make_scheduler(num_blocks=7, block_size=4, speculative_config=NGRAM)
    other = [9, 10, 11, 12, 13, 14, 15, 16, 10, 11]  # drafts 13 14 15 after its first token
    start(scheduler, ("a", REPEATING, 10, {}), ("b", other, 10, {}))
    assert scheduler.block_manager.num_free_blocks == 1
    step = scheduler.schedule()
    # The free block would hold "a"'s drafts, but "b" comes after "a" and may need it: "a"
    # decodes one token; "b", the last to be scheduled, takes it for its drafts.
    assert step.spec_token_ids == {"b": [13, 14, 15]}
    assert step.num_scheduled_tokens == {"a": 1, "b": 4}
    assert scheduler.num_preemptions == 0


def test_a_prefill_group_never_drafts():
    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    scheduler.prefill_only = True
    moved = replace(context("a", REPEATING, 20), generated_token_ids=[12])  # it generated one
    assert scheduler.add_request(moved, CLIENT) is None
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"a": 11} and step.spec_token_ids == {}


@pytest.mark.parametrize(
    "tokens",
    [[13, 99, 11], [-1], [1 << 32], []],  # changed a draft, out of range, nothing
)
def test_an_output_that_is_not_drafts_kept_fails_that_request_alone(tokens):
    scheduler = make_scheduler(block_size=4, speculative_config=NGRAM)
    start(scheduler, ("bad", REPEATING, 20, {}), ("innocent", REPEATING, 20, {"seed": 1}))
    step = scheduler.schedule()
    outputs = {"bad": output("bad", tokens), "innocent": output("innocent", [13, 10, 7])}
    results = scheduler.update_from_output(WorkerOutput(step.step_id, outputs))[CLIENT]
    assert results["bad"].error == MALFORMED_OUTPUT
    assert results["innocent"].result.tokens == [13, 10, 7]
    assert "bad" not in scheduler.requests
    scheduler.check_integrity()
    step = scheduler.schedule()  # hashes the blocks "innocent" filled: its third
    assert set(step.num_scheduled_tokens) == {"innocent"}
    assert scheduler.block_manager.num_cached_blocks == 3
