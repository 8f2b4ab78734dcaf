"""Structured output through xgrammar masks: greedy decoding on the default model (SmolLM2).

Requests are driven through the ModelRunner with hand-built ScheduledSteps (``StepDriver``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from interfaces import StructuredOutput
from interfaces.scheduler_to_worker import CachedRequestData, NewRequestData, ScheduledStep
from interfaces.worker_to_scheduler import GrammarsReady
from tests.support.step_driver import EOS, DrivenRequest, StepDriver, context, small_runner
from worker.grammar_compiler import GrammarCompiler
from worker.grammar_limits import GrammarLimits
from worker.model_runner import ModelRunner
from worker.structured_output import MaskFiller, RequestGrammar, allowed_token_mask, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PERSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
PHONE = StructuredOutput("regex", "[0-9]{3}-[0-9]{4}")
PERSON_QUESTION = "Describe a person named Alice who is 30 years old as JSON."
PHONE_QUESTION = "Give me a phone number."


@pytest.fixture(scope="module")
def runner(default_model_dir: Path) -> ModelRunner:
    return small_runner(default_model_dir, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def chat(tokenizer):
    def prompt(question: str) -> list[int]:
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids

    return prompt


def _generate(runner: ModelRunner, requests: list[DrivenRequest]) -> dict[str, list[int]]:
    driven = StepDriver(runner).run(requests)
    return {request_id: request.output_token_ids for request_id, request in driven.items()}


def test_unpack_bitmask():
    bitmask = torch.tensor([[0b101, -1], [0, -(1 << 31) | 1]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, *range(32, 40)]
    assert allowed[1].nonzero().flatten().tolist() == [32]
    assert allowed.shape == (2, 40)


class TimedMatcher:
    """A matcher whose fill takes ``seconds`` (asleep, as xgrammar's fill runs without the
    GIL), then allows ``allowed`` (ids below 31) or raises ``error``."""

    def __init__(self, seconds: float, allowed: tuple[int, ...] = (), error: str | None = None):
        self.seconds, self.allowed, self.error = seconds, allowed, error
        self.fills = self.questions = 0
        self.finished = threading.Event()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.fills += 1
        time.sleep(self.seconds)
        self.finished.set()
        if self.error is not None:
            raise RuntimeError(self.error)
        bitmask[row] = 0
        bitmask[row, 0] = sum(1 << token for token in self.allowed)

    def is_terminated(self) -> bool:
        self.questions += 1
        return False


@pytest.fixture
def fillers():
    """MaskFillers made by ``make(timeout_s, num_threads)``, closed after the test."""
    made = []

    def make(
        timeout_s: float, num_threads: int = 2, per_token_s: float | None = None
    ) -> MaskFiller:
        made.append(MaskFiller(timeout_s, "too slow", num_threads, per_token_s, "too dear"))
        return made[-1]

    yield make
    for filler in made:
        filler.close()


@pytest.fixture
def grammar_with(runner):
    """A RequestGrammar that follows a TimedMatcher."""
    compiled = runner.grammars.compile(StructuredOutput("regex", "[a-z]+"))

    def make(matcher: TimedMatcher) -> RequestGrammar:
        grammar = RequestGrammar(compiled, [EOS])
        grammar.matcher = matcher
        return grammar

    return make


def _allowed_ids(allowed: torch.Tensor, row: int) -> list[int]:
    return allowed[row].nonzero().flatten().tolist()


def _mask_threads() -> int:
    return sum(thread.name == "grammar-mask" for thread in threading.enumerate())


def test_a_mask_past_its_time_limit_fails_its_row_alone_and_is_never_asked_again(
    grammar_with, fillers
):
    """The step does not wait for a fill past the limit: its row allows nothing and fails with
    the limit's message, the other rows get their masks, and the abandoned grammar is not
    touched again (its thread may still be inside it). The stuck thread is replaced at once
    and exits after its fill."""
    before = _mask_threads()
    filler = fillers(0.5)
    slow = TimedMatcher(2.5, allowed=(1,))
    grammars = [grammar_with(TimedMatcher(0.01, (3, 5))), grammar_with(slow), None]
    failures: dict[int, str] = {}
    allowed = allowed_token_mask(grammars, 40, torch.device("cpu"), failures, filler)
    assert not slow.finished.is_set()  # the step went on while the slow fill ran
    assert failures == {1: "too slow"}
    assert _allowed_ids(allowed, 0) == [3, 5]
    assert _allowed_ids(allowed, 1) == []
    assert _allowed_ids(allowed, 2) == list(range(40))
    assert grammars[1].abandoned and _mask_threads() == before + 3
    questions = slow.questions
    failures = {}
    again = allowed_token_mask(grammars, 40, torch.device("cpu"), failures, filler)
    assert (slow.fills, slow.questions) == (1, questions)
    assert _allowed_ids(again, 1) == [] and failures == {1: "too slow"}
    with pytest.raises(RuntimeError, match="abandoned"):
        grammars[1].accept(1)
    slow.finished.wait(10)
    deadline = time.monotonic() + 10
    while _mask_threads() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _mask_threads() == before + 2  # the replaced thread left after its fill


def test_rows_waiting_for_a_thread_are_not_charged_for_the_rows_before_them(grammar_with, fillers):
    """One thread, three fills of 0.15 s under a limit of 0.4 s: 0.45 s in all, and each row
    within its own limit."""
    filler = fillers(0.4, num_threads=1)
    grammars = [grammar_with(TimedMatcher(0.15, (row,))) for row in range(3)]
    failures: dict[int, str] = {}
    allowed = allowed_token_mask(grammars, 40, torch.device("cpu"), failures, filler)
    assert failures == {}
    assert [_allowed_ids(allowed, row) for row in range(3)] == [[0], [1], [2]]


def test_a_fill_that_raises_fails_its_row_alone(grammar_with, fillers):
    grammars = [
        grammar_with(TimedMatcher(0.0, error="broken")),
        grammar_with(TimedMatcher(0.0, (7,))),
    ]
    failures: dict[int, str] = {}
    allowed = allowed_token_mask(grammars, 40, torch.device("cpu"), failures, fillers(1.0))
    assert failures == {0: "the grammar failed: broken"}
    assert _allowed_ids(allowed, 0) == [] and _allowed_ids(allowed, 1) == [7]
    assert not grammars[0].abandoned


def test_a_filler_that_cannot_start_a_thread_raises_and_leaves_no_fill_behind(
    grammar_with, fillers, monkeypatch
):
    """Its step raises (the sampler then samples row by row, each row failing alone); the
    fills it queued are never run, and once threads start again it fills as before."""
    filler = fillers(1.0)
    queued = TimedMatcher(0.0, (2,))

    def refuse(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        allowed_token_mask([grammar_with(queued)], 40, torch.device("cpu"), {}, filler)
    monkeypatch.undo()
    fresh = TimedMatcher(0.0, (4,))
    allowed = allowed_token_mask([grammar_with(fresh)], 40, torch.device("cpu"), {}, filler)
    assert _allowed_ids(allowed, 0) == [4]
    assert (queued.fills, fresh.fills) == (0, 1)


def test_masks_that_each_come_in_time_but_cost_too_much_together_fail_their_row_alone(
    grammar_with, fillers
):
    """Every fill of 0.1 s is within the limit of 0.5 s, but at 0.01 s a token on average the
    grammar's credit (0.5 s to start, 0.01 s more a fill, never above 0.5 s) loses at least
    0.09 s a fill: its row works while credit is left and fails with the budget's message at
    the fill that overdraws it (the 6th at the latest; sooner where this machine adds to the
    sleeps), and is never filled again; a grammar beside it whose masks are quick is untouched
    throughout."""
    filler = fillers(0.5, per_token_s=0.01)
    dear = TimedMatcher(0.1, allowed=(1,))
    cheap = TimedMatcher(0.0, allowed=(2,))
    grammars = [grammar_with(dear), grammar_with(cheap)]
    credit, failed_at = 0.5, None
    for step in range(1, 9):
        failures: dict[int, str] = {}
        allowed = allowed_token_mask(grammars, 40, torch.device("cpu"), failures, filler)
        assert _allowed_ids(allowed, 1) == [2]
        if failed_at is None:
            assert grammars[0].mask_credit_s <= min(0.5, credit + 0.01) - 0.1
            credit = grammars[0].mask_credit_s
            if credit >= 0:
                assert failures == {} and _allowed_ids(allowed, 0) == [1]
                continue
            failed_at = step
        assert failures == {0: "too dear"} and _allowed_ids(allowed, 0) == []
    assert failed_at is not None and failed_at <= 6
    assert dear.fills == failed_at and cheap.fills == 8
    assert not grammars[0].abandoned and not grammars[1].over_budget


def test_a_budget_without_its_message_is_refused():
    with pytest.raises(ValueError, match="budget_failure"):
        MaskFiller(0.5, "too slow", per_token_s=0.01)


def test_the_mask_limits_must_be_positive_and_finite():
    for value in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="grammar mask timeout"):
            GrammarLimits(mask_timeout_s=value)
        with pytest.raises(ValueError, match="grammar mask time per token"):
            GrammarLimits(mask_time_per_token_s=value)
    limits = GrammarLimits(mask_timeout_s=0.2, mask_time_per_token_s=0.03)
    assert limits.mask_timeout_error() == (
        "the grammar for structured output took longer than the limit of 0.2 s "
        "(--grammar-mask-timeout) to give the tokens that may come next"
    )
    assert limits.mask_budget_error() == (
        "the grammar for structured output took longer than the limit of 0.03 s a token on "
        "average (--grammar-mask-time-per-token) to give the tokens that may come next"
    )


def test_json_schema_greedy_output_parses_and_validates(runner, tokenizer, chat):
    request = DrivenRequest(context("person", chat(PERSON_QUESTION), 64, structured_output=PERSON))
    tokens = _generate(runner, [request])["person"]
    assert tokens[-1] == EOS  # the grammar ended the request, not the length limit
    value = json.loads(tokenizer.decode(tokens[:-1]))
    jsonschema.validate(value, SCHEMA)
    assert value == {"name": "Alice", "age": 30}


def test_regex_greedy_output_is_a_full_match(runner, tokenizer, chat):
    request = DrivenRequest(context("phone", chat(PHONE_QUESTION), 32, structured_output=PHONE))
    tokens = _generate(runner, [request])["phone"]
    text = tokenizer.decode(tokens[:-1])
    assert tokens[-1] == EOS and re.fullmatch("[0-9]{3}-[0-9]{4}", text)
    assert text == "123-4567"


def test_ebnf_grammar(runner, tokenizer, chat):
    yes_no = StructuredOutput("grammar", 'root ::= "yes" | "no"')
    request = DrivenRequest(
        context("answer", chat("Is the sky blue?"), 16, structured_output=yes_no)
    )
    tokens = _generate(runner, [request])["answer"]
    assert tokens[-1] == EOS and tokenizer.decode(tokens[:-1]) in {"yes", "no"}


def test_masks_apply_only_to_their_rows_in_a_chunked_batch(runner, chat):
    """Batched with an unconstrained request (prefilled in 2 chunks), both match their solo runs;
    a constrained request resumed after 4 tokens replays its grammar and continues the same."""
    prompt = chat(PHONE_QUESTION)
    solo = {
        "plain": _generate(runner, [DrivenRequest(context("plain", prompt, 8))])["plain"],
        "phone": _generate(
            runner, [DrivenRequest(context("phone", prompt, 16, structured_output=PHONE))]
        )["phone"],
    }
    assert solo["plain"][:3] != solo["phone"][:3]
    batch = [
        DrivenRequest(context("plain", prompt, 8), [10, len(prompt) - 10]),
        DrivenRequest(context("phone", prompt, 16, structured_output=PHONE)),
    ]
    assert _generate(runner, batch) == solo
    resumed = DrivenRequest(
        context("phone", prompt, 16, structured_output=PHONE), resumed_token_ids=solo["phone"][:4]
    )
    assert _generate(runner, [resumed])["phone"] == solo["phone"]


def test_an_ended_grammar_forces_eos_even_before_min_new_tokens(runner, tokenizer, chat):
    request = DrivenRequest(
        context("phone", chat(PHONE_QUESTION), 16, structured_output=PHONE, min_new_tokens=12)
    )
    tokens = _generate(runner, [request])["phone"]
    assert tokenizer.decode(tokens[:-4]) == "123-4567" and tokens[-4:] == [EOS] * 4


def test_a_queued_compile_whose_requests_gave_up_is_never_started(
    runner, blocked_compiles, monkeypatch
):
    """Two slow specs take both compile threads; a third spec queues. Its request's time limit
    runs while it queues, and once it has passed the compile is dropped, never run."""
    limits = runner.grammars.limits
    compiled = []
    compile_grammar = runner.grammars._compile

    def counted(grammar):
        compiled.append(grammar)
        return compile_grammar(grammar)

    monkeypatch.setattr(runner.grammars, "_compile", counted)
    pending = [
        runner.grammars.start(
            context(f"r{index}", [1], 8, structured_output=StructuredOutput("regex", pattern))
        )
        for index, pattern in enumerate(["a+", "b+", "c+"])
    ]
    for _ in range(3000):  # both threads are in a compile; the third job waits in the queue
        if len(compiled) == 2:
            break
        time.sleep(0.01)
    assert len(compiled) == 2 and not pending[2].job.future.done()
    pending[2].job.deadline = time.monotonic() - 1  # its only request gave up
    blocked_compiles.set()
    assert isinstance(pending[2].job.future.exception(timeout=30), ValueError)
    assert pending[2].poll() == limits.timeout_error("regex")
    assert len(compiled) == 2
    assert all(not isinstance(grammar.poll(), str) for grammar in pending[:2])


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (
            StructuredOutput("json_schema", '{"type": "foo"}'),
            'invalid json_schema for structured output: Unsupported type "foo"',
        ),
        (
            StructuredOutput("json_schema", "{not json"),
            "invalid json_schema for structured output: Expecting property name",
        ),
        (
            StructuredOutput("regex", "[0-9"),
            "invalid regex for structured output: "
            "Regex parsing error at position 5: Unclosed '\\['",
        ),
        (
            StructuredOutput("grammar", 'root ::= "a" | b'),
            "invalid grammar for structured output: "
            'EBNF parser error at line 1, column 16: Rule "b"',
        ),
    ],
)
def test_an_invalid_spec_refuses_only_its_request(runner, structured, message):
    good = NewRequestData(context("good", [1, 2, 3], 4), [0], 0)
    bad = NewRequestData(context("bad", [1, 2, 3], 4, structured_output=structured), [1], 0)
    step = ScheduledStep(0, [good, bad], num_scheduled_tokens={"good": 3, "bad": 3})
    assert list(runner.next_token(step)) == ["good"]
    refusals = runner.take_refusals()
    assert list(refusals) == ["bad"]
    assert re.match(f"^request 'bad': {message}", refusals["bad"])
    assert list(runner.requests) == ["good"]
    assert runner.take_refusals() == {}
    runner.release("good")


def test_compiled_grammars_are_cached_by_kind_and_spec(runner):
    compiled = runner.grammars.compile(PHONE)
    assert runner.grammars.compile(StructuredOutput("regex", PHONE.spec)) is compiled
    assert runner.grammars.compile(StructuredOutput("grammar", 'root ::= "x"')) is not compiled


# Grammars compile off the step


@pytest.fixture
def blocked_compiles(runner, monkeypatch):
    """Compiles wait for the returned event (set it to let them finish)."""
    release = threading.Event()
    compile_grammar = runner.grammars._compile

    def slow_compile(grammar):
        assert release.wait(30)
        return compile_grammar(grammar)

    monkeypatch.setattr(runner.grammars, "_compile", slow_compile)
    yield release
    release.set()


def _await_news(runner: ModelRunner) -> GrammarsReady:
    for _ in range(3000):
        news = runner.grammar_news()
        if news is not None:
            return news
        time.sleep(0.01)
    raise AssertionError("no grammar news")


def test_a_request_waits_for_its_grammar_while_the_batch_steps(
    runner, tokenizer, chat, blocked_compiles
):
    spec = StructuredOutput("grammar", 'root ::= "maybe" | "perhaps"')
    prompt = chat("Is the sky blue?")
    plain = NewRequestData(context("plain", [1, 2, 3], 8), [0], 0)
    waiting = NewRequestData(context("waiting", prompt, 8, structured_output=spec), [1, 2, 3], 0)
    step = ScheduledStep(0, [plain, waiting], num_scheduled_tokens={"plain": 3, "waiting": 35})
    assert len(prompt) == 35
    assert list(runner.next_token(step)) == ["plain"]
    assert runner.take_deferred() == ["waiting"]
    assert runner.take_failures() == {} and runner.grammar_news() is None
    cached = [CachedRequestData("plain", [], 3)]
    assert list(runner.next_token(ScheduledStep(1, [], cached, {"plain": 1}))) == ["plain"]
    blocked_compiles.set()
    assert _await_news(runner) == GrammarsReady(["waiting"], {})
    cached = [CachedRequestData("waiting", [], 34)]  # its last token again
    outputs = runner.next_token(ScheduledStep(2, [], cached, {"waiting": 1}))
    assert runner.take_deferred() == []
    first = tokenizer.decode(outputs["waiting"].tokens)
    assert first and ("maybe".startswith(first) or "perhaps".startswith(first))
    runner.next_token(ScheduledStep(3, finished_request_ids=["plain", "waiting"]))
    assert runner.requests == {}


def test_a_compile_past_the_time_limit_fails_its_request_alone(runner, blocked_compiles):
    limits = runner.grammars.limits
    spec = StructuredOutput("grammar", 'root ::= "slow" | "slower"')
    slow = NewRequestData(context("slow", [1, 2, 3], 8, structured_output=spec), [0], 0)
    assert runner.next_token(ScheduledStep(0, [slow], num_scheduled_tokens={"slow": 3})) == {}
    assert runner.take_deferred() == ["slow"]
    asked = runner.requests["slow"].pending_grammar.waiting_since  # the clock starts here
    assert runner.grammar_news(asked + limits.compile_timeout_s / 2) is None
    news = runner.grammar_news(asked + limits.compile_timeout_s + 1)
    assert news == GrammarsReady(
        [],
        {
            "slow": "compiling the grammar for structured output took longer than the limit of "
            "30 s (--grammar-compile-timeout)"
        },
    )
    runner.next_token(ScheduledStep(1, finished_request_ids=["slow"]))
    assert runner.requests == {}


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (
            StructuredOutput("regex", "a" * ((1 << 20) + 1)),
            "the regex for structured output is 1048577 bytes, more than the limit of 1048576 "
            "bytes (--max-grammar-bytes)",
        ),
        (
            StructuredOutput("json_schema", json.dumps({"enum": list(range(20_001))})),
            "the json_schema for structured output has 20001 alternatives, more than the limit "
            "of 20000 (--max-grammar-alternatives)",
        ),
    ],
)
def test_a_spec_over_the_limits_is_refused_before_compiling(runner, structured, message):
    big = NewRequestData(context("big", [1, 2, 3], 4, structured_output=structured), [0], 0)
    assert runner.next_token(ScheduledStep(0, [big], num_scheduled_tokens={"big": 3})) == {}
    assert runner.take_refusals() == {"big": f"request 'big': {message}"}
    assert runner.requests == {}


def test_the_grammar_cache_is_bounded_by_memory(default_model_dir):
    class Compiled:
        def __init__(self, memory_size_bytes: int) -> None:
            self.memory_size_bytes = memory_size_bytes

    grammars = GrammarCompiler(default_model_dir, 49152, limits=GrammarLimits(cache_bytes=100))
    grammars._remember(("regex", "a"), Compiled(60))
    grammars._remember(("regex", "b"), Compiled(30))
    assert (list(grammars._cache), grammars._cache_bytes) == ([("regex", "a"), ("regex", "b")], 90)
    grammars._remember(("regex", "c"), Compiled(50))  # the least recently used goes
    assert (list(grammars._cache), grammars._cache_bytes) == ([("regex", "b"), ("regex", "c")], 80)
    grammars._remember(("regex", "huge"), Compiled(101))  # bigger than the whole cache: not kept
    assert (list(grammars._cache), grammars._cache_bytes) == ([("regex", "b"), ("regex", "c")], 80)
    grammars.close()
