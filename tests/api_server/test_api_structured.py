"""Structured output: every spelling becomes the submitted context's ``structured_output``; bad
schemas, regexes and choices are 400s naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from interfaces import StructuredOutput
from tests.support.fake_scheduler import ApiHarness

MESSAGES = [{"role": "user", "content": "Give me JSON"}]
CHAT = "/v1/chat/completions"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    harness = ApiHarness(default_model_dir, tmp_path_factory.mktemp("api-structured"))
    harness.scheduler.reply = [19556]
    harness.scheduler.eos_token_id = 2
    yield harness
    harness.close()


def json_schema_format(schema, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


SCHEMA_OUTPUT = StructuredOutput("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
GRAMMAR = 'root ::= "yes" | "no"'
QUOTED_CHOICE = StructuredOutput("grammar", 'root ::= "say \\"hi\\"" | "é"')


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": json_schema_format(SCHEMA)}, SCHEMA_OUTPUT),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}},
            StructuredOutput("json_object"),
        ),
        ({"guided_json": SCHEMA}, SCHEMA_OUTPUT),
        ({"guided_json": json.dumps(SCHEMA)}, SCHEMA_OUTPUT),
        ({"guided_regex": r"\d{3}-\d{4}"}, StructuredOutput("regex", r"\d{3}-\d{4}")),
        ({"guided_grammar": GRAMMAR}, StructuredOutput("grammar", GRAMMAR)),
        ({"structured_outputs": {"json": SCHEMA}}, SCHEMA_OUTPUT),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
        ({"structured_outputs": {"grammar": GRAMMAR}}, StructuredOutput("grammar", GRAMMAR)),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("grammar", GRAMMAR)),
        ({"structured_outputs": {"choice": ['say "hi"', "é"]}}, QUOTED_CHOICE),
    ],
)
def test_constraints_reach_the_scheduler(
    api: ApiHarness, client: httpx.Client, extra: dict, expected: StructuredOutput | None
) -> None:
    assert client.post(CHAT, json={"messages": MESSAGES, **extra}).status_code == 200
    assert api.scheduler.submitted[-1].structured_output == expected
    assert client.post("/v1/completions", json={"prompt": "x", **extra}).status_code == 200
    assert api.scheduler.submitted[-1].structured_output == expected


NOT_UNDER_ANY = "is not valid under any of the given schemas"
EXACTLY_ONE = (
    "structured_outputs must set exactly one of json, regex, grammar, choice or json_object"
)
NOT_A_REGEX = "is not a valid regular expression:"


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"response_format": json_schema_format({"type": "nonsense"})},
            "response_format",
            "response_format.json_schema.schema is not a valid JSON schema: "
            f"'nonsense' {NOT_UNDER_ANY}",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "response_format of type 'json_schema' needs a 'json_schema' object",
        ),
        (
            {"response_format": {"type": "xml"}},
            "response_format.type",
            "response_format.type: Input should be 'text', 'json_object' or 'json_schema'",
        ),
        (
            {"guided_json": {"properties": {"a": {"type": 5}}}},
            "guided_json",
            f"guided_json is not a valid JSON schema: 5 {NOT_UNDER_ANY}",
        ),
        (
            {"guided_json": "{not json"},
            "guided_json",
            "guided_json is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        (
            {"guided_regex": "(unclosed"},
            "guided_regex",
            f"guided_regex {NOT_A_REGEX} missing ), unterminated subpattern at position 0",
        ),
        (
            {"structured_outputs": {"regex": "["}},
            "structured_outputs.regex",
            f"structured_outputs.regex {NOT_A_REGEX} unterminated character set at position 0",
        ),
        ({"guided_grammar": "  "}, "guided_grammar", "guided_grammar must not be empty"),
        (
            {"guided_choice": []},
            "guided_choice",
            "guided_choice must be a list of non-empty strings",
        ),
        (
            {"structured_outputs": {"choice": ["a", ""]}},
            "structured_outputs.choice",
            "structured_outputs.choice must be a list of non-empty strings",
        ),
        ({"structured_outputs": {}}, "structured_outputs", EXACTLY_ONE),
        ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs", EXACTLY_ONE),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "response_format",
            "Only one structured-output constraint may be given; got response_format, guided_regex",
        ),
    ],
)
def test_bad_constraints_are_400s(
    client: httpx.Client, extra: dict, param: str, message: str
) -> None:
    response = client.post(CHAT, json={"messages": MESSAGES, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["message"]) == (
        "invalid_request_error",
        param,
        message,
    )


def test_openai_client_response_format(api: ApiHarness) -> None:
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", timeout=10, max_retries=0)
    client.chat.completions.create(
        model=api.MODEL_NAME,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    )
    assert api.scheduler.submitted[-1].structured_output == SCHEMA_OUTPUT
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=api.MODEL_NAME, messages=MESSAGES, extra_body={"guided_regex": "(("}
        )
    assert raised.value.body["param"] == "guided_regex"
