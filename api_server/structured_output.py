"""Structured-output requests → ``interfaces.StructuredOutput``, checked before they are queued.

Three spellings name a constraint: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with ``json_schema.schema``), vLLM's ``structured_outputs`` (``json``, ``regex``,
``grammar``, ``choice``, ``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_grammar`` / ``guided_choice``. A request may use at most one. JSON schemas are checked
against the JSON Schema 2020-12 meta-schema and regexes with Python's ``re``, so most bad
constraints are a 400 here rather than a failure in the worker; grammars are passed on unchecked
(the worker compiles them); a choice becomes a grammar of its alternatives. The worker applies
the constraint as token masks.

Each constraint's text is bounded (``max_bytes``, the API server's
``--max-structured-output-bytes``) before anything else looks at it: meta-validating a schema
is slow in pure Python, and the text travels to the scheduler inside the request's frame.
Schemas travel as compact JSON with non-ASCII characters as they are (escaping them would
triple their size). These checks are CPU work; the API server runs them off its event loop.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from jsonschema import Draft202012Validator, SchemaError

from api_server.errors import invalid_request
from api_server.protocol import ResponseFormat, SamplingFields, StructuredOutputsParams
from interfaces import StructuredOutput

JsonSpec = str | dict[str, Any] | bool


def structured_output(request: SamplingFields, max_bytes: int | None) -> StructuredOutput | None:
    """The request's constraint on generated text, or None; a 400 naming the field when the
    constraint is invalid, unsupported, given more than once, or its text takes more than
    ``max_bytes`` (None: no bound)."""
    sources = {
        "response_format": _from_response_format(request.response_format, max_bytes),
        "structured_outputs": _from_structured_outputs(request.structured_outputs, max_bytes),
        "guided_json": json_schema_output(request.guided_json, "guided_json", max_bytes=max_bytes),
        "guided_regex": _regex(request.guided_regex, "guided_regex", max_bytes),
        "guided_grammar": _grammar(request.guided_grammar, "guided_grammar", max_bytes),
        "guided_choice": _choice(request.guided_choice, "guided_choice", max_bytes),
    }
    given = {name: output for name, output in sources.items() if output is not None}
    if len(given) > 1:
        names = ", ".join(given)
        raise invalid_request(
            f"Only one structured-output constraint may be given; got {names}",
            param=next(iter(given)),
        )
    return next(iter(given.values()), None)


def _from_response_format(
    response_format: ResponseFormat | None, max_bytes: int | None
) -> StructuredOutput | None:
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
    return json_schema_output(json_schema.schema_, "response_format", where, max_bytes)


def _from_structured_outputs(
    params: StructuredOutputsParams | None, max_bytes: int | None
) -> StructuredOutput | None:
    if params is None:
        return None
    outputs = [
        json_schema_output(params.json_, "structured_outputs.json", max_bytes=max_bytes),
        _regex(params.regex, "structured_outputs.regex", max_bytes),
        _grammar(params.grammar, "structured_outputs.grammar", max_bytes),
        _choice(params.choice, "structured_outputs.choice", max_bytes),
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
    spec: JsonSpec | None, param: str, where: str | None = None, max_bytes: int | None = None
) -> StructuredOutput | None:
    """A ``json_schema`` constraint from a schema given as an object or as JSON text, whose
    text (as given, and as sent) takes at most ``max_bytes`` (None: no bound)."""
    if spec is None:
        return None
    where = where or param
    schema: Any = spec
    if isinstance(spec, str):
        check_size(spec, param, max_bytes, where)
        try:
            schema = json.loads(spec)
        except (ValueError, RecursionError) as error:
            raise invalid_request(f"{where} is not valid JSON: {error}", param=param) from error
    text = _compact_json(schema, param, where)
    check_size(text, param, max_bytes, where)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as error:
        raise invalid_request(
            f"{where} is not a valid JSON schema: {error.message}", param=param
        ) from error
    except RecursionError as error:
        raise invalid_request(f"{where} is nested too deeply", param=param) from error
    return StructuredOutput("json_schema", text)


def check_size(text: str, param: str, max_bytes: int | None, where: str | None = None) -> None:
    """400 when ``text`` takes more than ``max_bytes`` in UTF-8 (None: no bound)."""
    if max_bytes is None:
        return
    num_bytes = len(text.encode("utf-8", "surrogatepass"))
    if num_bytes > max_bytes:
        raise invalid_request(
            f"{where or param} takes {num_bytes} bytes; the limit is {max_bytes} bytes "
            "(--max-structured-output-bytes)",
            param=param,
        )


def _compact_json(value: Any, param: str, where: str) -> str:
    """``value`` as compact JSON text, non-ASCII characters kept as they are."""
    try:
        try:
            return msgspec.json.encode(value).decode()
        except UnicodeEncodeError:  # a lone surrogate: escaped, as UTF-8 cannot hold it
            return json.dumps(value, separators=(",", ":"))
    except RecursionError as error:
        raise invalid_request(f"{where} is nested too deeply", param=param) from error


def _regex(pattern: str | None, param: str, max_bytes: int | None) -> StructuredOutput | None:
    if pattern is None:
        return None
    check_size(pattern, param, max_bytes)
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        message = f"{param} is not a valid regular expression: {error}"
        raise invalid_request(message, param=param) from error
    return StructuredOutput("regex", pattern)


def _grammar(grammar: str | None, param: str, max_bytes: int | None) -> StructuredOutput | None:
    if grammar is None:
        return None
    check_size(grammar, param, max_bytes)
    if not grammar.strip():
        raise invalid_request(f"{param} must not be empty", param=param)
    return StructuredOutput("grammar", grammar)


def _choice(
    choices: list[str] | None, param: str, max_bytes: int | None
) -> StructuredOutput | None:
    """One of ``choices`` exactly, as an EBNF grammar (a JSON string is an EBNF literal); the
    grammar's text is what ``max_bytes`` bounds."""
    if choices is None:
        return None
    if not choices or not all(choices):
        raise invalid_request(f"{param} must be a list of non-empty strings", param=param)
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    grammar = f"root ::= {alternatives}"
    check_size(grammar, param, max_bytes)
    return StructuredOutput("grammar", grammar)
