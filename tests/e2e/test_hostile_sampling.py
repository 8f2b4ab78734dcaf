"""Hostile sampling settings and grammars beside an innocent stream, on a real `switchyard serve`
(the default model): the innocent stream completes with the tokens it gets alone, the hostile
request gets its answer or a clear 400, and the server stays healthy.

A string ``pattern`` of optional letters (``[a-z]?`` written n times) is small to send but slow
for xgrammar to compile, in time quadratic in n (on an idle 2-core machine with xgrammar 0.2.8 and
0.2.9 alike: 1.2 s for 60, 48-57 s for 300; ``benchmarks/grammar_costs.py``), which makes the slow
compiles here: the API server's caps (bytes, choices) keep a choice list or enum fast. (Strings
with a ``maxLength`` were slow under 0.2.8, 9 s for ten of 300 characters, and take milliseconds
since 0.2.9.)
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.support.clients import health_status, in_background
from tests.support.serve_process import (
    COMPILE_TIMEOUT_S,
    DEFAULT_MODEL_NAME,
    MASK_TIME_PER_TOKEN_S,
    MASK_TIMEOUT_S,
    ServeProcess,
    chat_messages,
)
from worker.grammar_limits import GrammarLimits

pytestmark = pytest.mark.slow

INNOCENT = {
    "model": DEFAULT_MODEL_NAME,
    "messages": chat_messages("Name three colours."),
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


AMBIGUOUS_GRAMMAR = "root ::= (a | b)*\na ::= ([a-z] | [a-z] a)\nb ::= ([a-z]* b?)"
"""Letters, each string of them parsed in ever more ways: xgrammar keeps every parse alive, so
its next-token mask costs more at every token (0.5 ms at the first, 0.6 s at the 25th)."""


def slow_schema(num_letters: int) -> dict:
    """An object whose one string ``p0`` has at most ``num_letters`` lowercase letters, written
    as that many optional letters."""
    pattern = "^" + "[a-z]?" * num_letters + "$"
    return {
        "type": "object",
        "properties": {"p0": {"type": "string", "pattern": pattern}},
        "required": ["p0"],
    }


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def chat(question: str, **fields) -> dict:
    return {"model": DEFAULT_MODEL_NAME, "messages": chat_messages(question), **fields}


@pytest.fixture(scope="module")
def serve(hostile_serve):
    """The server the hostile-input modules share, with ``--grammar-compile-timeout 10``
    (tests/e2e/conftest.py); stopped after this module, whose last grammar is still
    compiling."""
    yield hostile_serve.get()
    hostile_serve.stop()


@pytest.fixture(scope="module")
def innocent_alone(serve) -> str:
    outcome, thread = in_background(serve.base_url, INNOCENT)
    thread.join(60)
    return _text(outcome)


def _text(outcome) -> str:
    assert outcome.status == 200 and outcome.finish_reasons == ["length"], outcome
    return "".join(
        choice["delta"].get("content") or ""
        for event in outcome.events
        for choice in event.get("choices", [])
    )


def _post(serve: ServeProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{serve.base_url}/v1/chat/completions", json=body, timeout=120)


def test_a_tiny_temperature_with_a_schema_runs_beside_an_innocent_stream(serve, innocent_alone):
    """``temperature: 1e-300`` is 0.0 in float32: the worker treats it as greedy instead of
    dividing by it (which made NaN logits, sampled a token the grammar forbade and failed the
    whole batch)."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}}
    hostile = chat(
        "Name a colour as JSON.",
        temperature=1e-300,
        max_tokens=24,
        response_format=json_schema_format(schema),
    )
    lowest_penalty = {**hostile, "temperature": 0.7, "seed": 1, "repetition_penalty": 0.01}
    innocent, thread = in_background(serve.base_url, INNOCENT)
    answers = [_post(serve, hostile), _post(serve, lowest_penalty)]
    thread.join(60)
    assert _text(innocent) == innocent_alone
    for answer in answers:
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert set(json.loads(choice["message"]["content"])) <= {"colour"}
    greedy = _post(serve, {**hostile, "temperature": 0})
    assert answers[0].json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]


def test_a_penalty_that_is_not_finite_in_float32_is_refused(serve):
    answer = _post(serve, chat("Hi", repetition_penalty=1e-300, max_tokens=4))
    assert answer.status_code == 400
    assert "repetition_penalty" in answer.text


def test_a_slow_compile_does_not_stall_the_batch_and_its_request_waits(serve, innocent_alone):
    """The grammar compiles on a worker thread while the innocent stream keeps stepping; the
    grammar request waits outside the batch and then answers within its schema. Greedy: sampled,
    an answer may run to the length limit before closing its string (it did in one CI run)."""
    schema = slow_schema(60)
    body = chat(
        "Say hello as JSON.",
        max_tokens=32,
        temperature=0,
        response_format=json_schema_format(schema),
    )
    innocent, thread = in_background(serve.base_url, INNOCENT)
    grammar = _post(serve, body)
    thread.join(60)
    assert _text(innocent) == innocent_alone
    assert grammar.status_code == 200, grammar.text
    choice = grammar.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert re.fullmatch("[a-z]{0,60}", json.loads(choice["message"]["content"])["p0"])


def test_a_grammar_whose_masks_grow_slow_fails_alone_with_a_400(serve, innocent_alone):
    """The ambiguous grammar's masks grow slower with every token (min_tokens keeps the model
    writing letters): the grammar request gets a 400 naming ``--grammar-mask-time-per-token``,
    the innocent stream sent meanwhile gets the tokens it gets alone, and /health stays 200.
    Without the limits this request would run for minutes, every step of its batch waiting
    seconds for its mask, longer with each token. Its masks spend the budget (0.2 s of credit,
    0.005 s more a token) while they take ~40 ms each (walked with tokens of one to three
    letters: about the 19th token), where the mask limit of 0.2 s would take a single mask
    five times slower (the mask limit's own behaviour is pinned in
    test_structured_output.py)."""
    body = chat(
        "Write a very long word.",
        max_tokens=200,
        min_tokens=200,
        temperature=0,
        guided_grammar=AMBIGUOUS_GRAMMAR,
    )
    grammar, grammar_thread = in_background(serve.base_url, {**body, "stream": False})
    innocent, thread = in_background(serve.base_url, INNOCENT)
    thread.join(60)
    grammar_thread.join(120)
    assert _text(innocent) == innocent_alone
    assert grammar.status == 400, grammar
    limits = GrammarLimits(
        mask_timeout_s=MASK_TIMEOUT_S, mask_time_per_token_s=MASK_TIME_PER_TOKEN_S
    )
    assert grammar.body["error"]["message"] == limits.mask_budget_error()
    assert health_status(serve.base_url) == 200


def test_a_compile_past_the_time_limit_fails_alone_with_a_400(serve, innocent_alone):
    """Three hundred optional letters compile for well over the limit (48-57 s on an idle 2-core
    machine against the limit of 10 s: a margin that a fast machine does not eat; the server is
    stopped after this module, compile and all): the innocent stream finishes long before the
    grammar request hears anything, /health stays 200 meanwhile, and the grammar request gets a
    400 naming the limit."""
    schema = slow_schema(300)
    body = chat("Fill in the form.", max_tokens=16, response_format=json_schema_format(schema))
    started = time.monotonic()
    grammar, grammar_thread = in_background(serve.base_url, {**body, "stream": False})
    innocent, thread = in_background(serve.base_url, INNOCENT)
    health = []
    while thread.is_alive():
        health.append(health_status(serve.base_url))
        time.sleep(0.1)
    grammar_thread.join(120)
    assert _text(innocent) == innocent_alone
    assert health and set(health) == {200}
    assert innocent.ended_at < grammar.ended_at
    assert grammar.ended_at - started >= COMPILE_TIMEOUT_S
    assert grammar.status == 400
    assert grammar.body["error"]["message"] == (
        "compiling the json_schema for structured output took longer than the limit of "
        f"{COMPILE_TIMEOUT_S} s (--grammar-compile-timeout)"
    )
    assert health_status(serve.base_url) == 200
