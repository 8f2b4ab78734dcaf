"""Structured-output requests → ``interfaces.StructuredOutput``, checked before they are queued.

Three spellings name a constraint: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with ``json_schema.schema``), vLLM's ``structured_outputs`` (``json``, ``regex``,
``grammar``, ``choice``, ``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_grammar`` / ``guided_choice``. A request may use at most one. JSON schemas are checked
against the JSON Schema 2020-12 meta-schema and regexes with Python's ``re``, so most bad
constraints are a 400 here rather than a failure in the worker; grammars are passed on unchecked
(the worker compiles them); a choice becomes a grammar of its alternatives. The worker applies
the constraint as token masks.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import Draft202012Validator, SchemaError

from api_server.errors import invalid_request
from api_server.protocol import ResponseFormat, SamplingFields, StructuredOutputsParams
from interfaces import StructuredOutput

JsonSpec = str | dict[str, Any] | bool


def structured_output(request: SamplingFields) -> StructuredOutput | None:
    """The request's constraint on generated text, or None; a 400 naming the field when the
    constraint is invalid, unsupported, or given more than once."""
    sources = {
        "response_format": _from_response_format(request.response_format),
        "structured_outputs": _from_structured_outputs(request.structured_outputs),
        "guided_json": json_schema_output(request.guided_json, "guided_json"),
        "guided_regex": _regex(request.guided_regex, "guided_regex"),
        "guided_grammar": _grammar(request.guided_grammar, "guided_grammar"),
        "guided_choice": _choice(request.guided_choice, "guided_choice"),
    }
    given = {name: output for name, output in sources.items() if output is not None}
    if len(given) > 1:
        names = ", ".join(given)
        raise invalid_request(
            f"Only one structured-output constraint may be given; got {names}",
            param=next(iter(given)),
        )
    return next(iter(given.values()), None)


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    json_schema = response_format.json_schema
    if json_schema is None:
        raise invalid_request(
            "response_format of type 'json_schema' needs a 'json_schema' object",
            param="response_format",
        )
    if json_schema.schema_ is None:
        return StructuredOutput("json_object")
    where = "response_format.json_schema.schema"
    return json_schema_output(json_schema.schema_, "response_format", where)


def _from_structured_outputs(params: StructuredOutputsParams | None) -> StructuredOutput | None:
    if params is None:
        return None
    outputs = [
        json_schema_output(params.json_, "structured_outputs.json"),
        _regex(params.regex, "structured_outputs.regex"),
        _grammar(params.grammar, "structured_outputs.grammar"),
        _choice(params.choice, "structured_outputs.choice"),
        StructuredOutput("json_object") if params.json_object else None,
    ]
    given = [output for output in outputs if output is not None]
    if len(given) != 1:
        raise invalid_request(
            "structured_outputs must set exactly one of json, regex, grammar, choice or "
            "json_object",
            param="structured_outputs",
        )
    return given[0]


def json_schema_output(
    spec: JsonSpec | None, param: str, where: str | None = None
) -> StructuredOutput | None:
    """A ``json_schema`` constraint from a schema given as an object or as JSON text."""
    if spec is None:
        return None
    where = where or param
    schema: Any = spec
    if isinstance(spec, str):
        try:
            schema = json.loads(spec)
        except ValueError as error:
            raise invalid_request(f"{where} is not valid JSON: {error}", param=param) from error
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as error:
        raise invalid_request(
            f"{where} is not a valid JSON schema: {error.message}", param=param
        ) from error
    except RecursionError as error:
        raise invalid_request(f"{where} is nested too deeply", param=param) from error
    return StructuredOutput("json_schema", json.dumps(schema))


def _regex(pattern: str | None, param: str) -> StructuredOutput | None:
    if pattern is None:
        return None
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        message = f"{param} is not a valid regular expression: {error}"
        raise invalid_request(message, param=param) from error
    return StructuredOutput("regex", pattern)


def _grammar(grammar: str | None, param: str) -> StructuredOutput | None:
    if grammar is None:
        return None
    if not grammar.strip():
        raise invalid_request(f"{param} must not be empty", param=param)
    return StructuredOutput("grammar", grammar)


def _choice(choices: list[str] | None, param: str) -> StructuredOutput | None:
    """One of ``choices`` exactly, as an EBNF grammar (a JSON string is an EBNF literal)."""
    if choices is None:
        return None
    if not choices or not all(choices):
        raise invalid_request(f"{param} must be a list of non-empty strings", param=param)
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return StructuredOutput("grammar", f"root ::= {alternatives}")
