"""Structured output through xgrammar masks: greedy decoding on the default model (SmolLM2).

Requests are driven through the ModelRunner with hand-built SchedulerOutputs (``StepDriver``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from interfaces import StructuredOutput
from interfaces.scheduler_to_worker import NewRequestData, SchedulerOutput
from tests.test_worker_sampling import EOS, DrivenRequest, StepDriver, context, small_runner
from worker.model_runner import ModelRunner
from worker.structured_output import unpack_bitmask

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
    step = SchedulerOutput(0, [good, bad], num_scheduled_tokens={"good": 3, "bad": 3})
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
