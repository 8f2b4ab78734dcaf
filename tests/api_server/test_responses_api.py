"""The Responses API (POST, GET and DELETE /v1/responses) with the official openai client against
the fake scheduler: whole and streamed responses, the store shared by two API servers,
tools, structured output, and every bad request a 400 or 404 beside an innocent stream; the
SQLite store's bounds and failures directly."""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import warnings
from pathlib import Path

import httpx
import openai
import pytest

from api_server.response_store import (
    ResponseStore,
    ResponseStoreConfig,
    StoredResponse,
    StoreUnavailable,
)
from interfaces import StructuredOutput
from tests.support.fake_scheduler import ApiHarness

REPLY = "Hello! How can I help?"
EOS = 2
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
CALL_TEXT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # No test here waits out a silent scheduler: a stall of this shared machine must not pass
    # for one (the harness's 1 s default failed a request once in CI).
    harness = ApiHarness(
        default_model_dir, tmp_path_factory.mktemp("api-responses"), 1024, scheduler_timeout_s=30
    )
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def other_api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A second API server of the same deployment: its own scheduler, the same store (both
    take the default directory under the session's SWITCHYARD_CACHE_DIR)."""
    harness = ApiHarness(
        default_model_dir, tmp_path_factory.mktemp("api-responses-2"), 1024, scheduler_timeout_s=30
    )
    yield harness
    harness.close()


@pytest.fixture(autouse=True)
def reply(api: ApiHarness):
    """Make every request of ``api`` generate ``text`` (REPLY by default) then EOS."""

    def set_reply(text: str, harness: ApiHarness = api) -> list[int]:
        harness.scheduler.reply = harness.tokenizer.encode_now(text, add_special_tokens=False)
        harness.scheduler.eos_token_id = EOS
        return harness.scheduler.reply

    set_reply(REPLY)
    yield set_reply
    api.scheduler.reset()


@pytest.fixture
def client(api: ApiHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", timeout=10, max_retries=0)


@pytest.fixture
def http(api: ApiHarness):
    with httpx.Client(base_url=api.url, timeout=10) as http_client:
        yield http_client


def submitted_prompt(harness: ApiHarness) -> str:
    token_ids = harness.scheduler.submitted[-1].prompt_token_ids
    return harness.tokenizer.backend.decode(token_ids, skip_special_tokens=False)


def chat_prompt(harness: ApiHarness, messages: list[dict], **options) -> str:
    return harness.tokenizer.apply_chat_template(messages, **options)


def sse_events(response: httpx.Response) -> list[dict]:
    """The events of a Responses stream, checking that each ``event:`` names its data's type
    and that ``sequence_number`` counts from 0."""
    events = []
    for block in response.text.split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def test_create_with_instructions(api: ApiHarness, client: openai.OpenAI, reply) -> None:
    token_ids = reply(REPLY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        response = client.responses.create(
            model=api.MODEL_NAME,
            input="Hi",
            instructions="Be brief.",
            temperature=0,
            top_p=0.5,
            max_output_tokens=50,
            metadata={"topic": "greeting"},
        )
    assert response.id.startswith("resp_") and len(response.id) == len("resp_") + 32
    assert (response.object, response.status, response.model) == (
        "response",
        "completed",
        api.MODEL_NAME,
    )
    assert response.output_text == REPLY
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.id.startswith("msg_")
    assert (response.instructions, response.max_output_tokens, response.store) == (
        "Be brief.",
        50,
        True,
    )
    assert response.metadata == {"topic": "greeting"}
    expected = chat_prompt(
        api,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert submitted_prompt(api) == expected
    context = api.scheduler.submitted[-1]
    params = context.sampling_params
    assert (params.temperature, params.top_p, params.max_new_tokens) == (0.0, 0.5, 50)
    assert context.request_id.startswith(f"{response.id}-")
    num_input_tokens = len(context.prompt_token_ids)
    assert response.usage.input_tokens == num_input_tokens
    assert response.usage.output_tokens == len(token_ids) + 1  # EOS counts
    assert response.usage.total_tokens == num_input_tokens + len(token_ids) + 1
    assert response.usage.input_tokens_details.cached_tokens == 0


def test_stream_events_in_openai_order(api: ApiHarness, http: httpx.Client) -> None:
    response = http.post("/v1/responses", json={"input": "Hi", "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    types = [event["type"] for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert num_deltas > 3
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    deltas = [event["delta"] for event in events if event["type"].endswith(".delta")]
    assert "".join(deltas) == REPLY
    final = events[-1]["response"]
    item_id = final["output"][0]["id"]
    assert {event.get("item_id", item_id) for event in events[2:-1]} == {item_id}
    assert events[-4]["text"] == REPLY
    assert events[-2]["item"] == final["output"][0]
    assert final["output"][0]["content"] == [
        {"type": "output_text", "text": REPLY, "annotations": [], "logprobs": []}
    ]
    stored = http.get(f"/v1/responses/{final['id']}").json()
    assert stored == final


def test_openai_stream_and_stream_manager(api: ApiHarness, client: openai.OpenAI) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        events = list(client.responses.create(model=api.MODEL_NAME, input="Hi", stream=True))
        with client.responses.stream(model=api.MODEL_NAME, input="Hi") as stream:
            texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
            final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == REPLY
    assert "".join(texts) == REPLY
    assert final.output_text == REPLY
    assert client.responses.retrieve(final.id).output_text == REPLY


def test_retrieve_and_delete(api: ApiHarness, client: openai.OpenAI, http: httpx.Client) -> None:
    created = client.responses.create(model=api.MODEL_NAME, input="Hi")
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    assert client.responses.delete(created.id) is None
    deleted = http.delete(f"/v1/responses/{created.id}")
    assert deleted.status_code == 404
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.retrieve(created.id)
    assert raised.value.body["message"] == f"Response with id '{created.id}' not found."


def test_delete_answers_the_deleted_object(api: ApiHarness, http: httpx.Client) -> None:
    created = http.post("/v1/responses", json={"input": "Hi"}).json()
    deleted = http.delete(f"/v1/responses/{created['id']}")
    assert deleted.json() == {"id": created["id"], "object": "response.deleted", "deleted": True}


def test_store_false_is_not_retrievable(api: ApiHarness, client: openai.OpenAI) -> None:
    response = client.responses.create(model=api.MODEL_NAME, input="Hi", store=False)
    assert (response.store, response.output_text) == (False, REPLY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=api.MODEL_NAME, input="Hi", previous_response_id=response.id)


def test_conversation_continues_on_another_api_server(
    api: ApiHarness, other_api: ApiHarness, client: openai.OpenAI, reply
) -> None:
    first = client.responses.create(model=api.MODEL_NAME, input="Hi", instructions="Be brief.")
    reply("Paris.", other_api)
    other = openai.OpenAI(base_url=f"{other_api.url}/v1", api_key="unused", max_retries=0)
    second = other.responses.create(
        model=api.MODEL_NAME,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Capital?"}]}],
        previous_response_id=first.id,
        instructions="Answer in one word.",
    )
    assert (second.output_text, second.previous_response_id) == ("Paris.", first.id)
    # The first instructions are not carried over (as OpenAI).
    expected = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "Capital?"},
    ]
    assert submitted_prompt(other_api) == chat_prompt(other_api, expected)
    third = client.responses.create(
        model=api.MODEL_NAME, input="Thanks", previous_response_id=second.id
    )
    assert submitted_prompt(api) == chat_prompt(
        api,
        [
            *expected[1:],
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "Thanks"},
        ],
    )
    assert client.responses.retrieve(third.id).previous_response_id == second.id


def test_long_texts_in_every_place(api: ApiHarness, client: openai.OpenAI) -> None:
    text = "word " * 200  # more characters than any list bound
    parts = [{"type": "input_text", "text": text}, {"type": "input_text", "text": "end"}]
    response = client.responses.create(
        model=api.MODEL_NAME,
        input=[
            {"role": "user", "content": parts},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": text},
        ],
        instructions=text,
    )
    assert response.output_text == REPLY
    assert submitted_prompt(api).count(text) == 3


def test_max_output_tokens_makes_it_incomplete(api: ApiHarness, http: httpx.Client, reply) -> None:
    token_ids = reply(REPLY)
    request = {"input": "Hi", "max_output_tokens": 3}
    body = http.post("/v1/responses", json=request).json()
    text = api.tokenizer.backend.decode(token_ids[:3])
    assert (body["status"], body["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert body["output"][0]["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == text
    assert body["usage"]["output_tokens"] == 3
    events = sse_events(http.post("/v1/responses", json={**request, "stream": True}))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_text_format_json_schema_is_structured_output(
    api: ApiHarness, client: openai.OpenAI, reply
) -> None:
    reply('{"name": "Ada"}')
    text_format = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    response = client.responses.create(
        model=api.MODEL_NAME, input="Who?", text={"format": text_format}
    )
    expected = StructuredOutput("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    assert api.scheduler.submitted[-1].structured_output == expected
    assert json.loads(response.output_text) == {"name": "Ada"}
    assert response.text.format.type == "json_schema"
    client.responses.create(
        model=api.MODEL_NAME, input="x", text={"format": {"type": "json_object"}}
    )
    assert api.scheduler.submitted[-1].structured_output == StructuredOutput("json_object")


def test_function_call_and_its_output_continue(
    api: ApiHarness, client: openai.OpenAI, reply
) -> None:
    reply(CALL_TEXT)
    response = client.responses.create(
        model=api.MODEL_NAME, input="Weather in Paris?", tools=[WEATHER]
    )
    message, call = response.output
    assert (message.type, message.content[0].text) == ("message", "Checking.")
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert response.tools[0].name == "get_weather"
    assert json.dumps(
        {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
    ) in submitted_prompt(api)

    reply("It is sunny.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}
    answer = client.responses.create(
        model=api.MODEL_NAME, input=[output], previous_response_id=response.id, tools=[WEATHER]
    )
    assert answer.output_text == "It is sunny."
    prompt = submitted_prompt(api)
    assert '"name": "get_weather"' in prompt.split("Weather in Paris?")[1]
    assert prompt.index("Checking.") < prompt.index("18C, sunny")


def test_a_call_the_model_named_oddly_still_continues(
    api: ApiHarness, client: openai.OpenAI, reply
) -> None:
    """The tool parser takes any name the model writes; the stored output must read back."""
    reply('<tool_call>\n{"name": "get weather", "arguments": {}}\n</tool_call>')
    response = client.responses.create(model=api.MODEL_NAME, input="?", tools=[WEATHER])
    [call] = response.output
    assert (call.type, call.name) == ("function_call", "get weather")
    reply("Done.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "?"}
    answer = client.responses.create(
        model=api.MODEL_NAME, input=[output], previous_response_id=response.id
    )
    assert answer.output_text == "Done."


def test_a_tool_conversation_without_the_store(
    api: ApiHarness, client: openai.OpenAI, reply
) -> None:
    """The client sends the whole conversation back, the answer's own items included."""
    reply(CALL_TEXT)
    items: list = [{"role": "user", "content": "Weather?"}]
    response = client.responses.create(
        model=api.MODEL_NAME, input=items, tools=[WEATHER], store=False
    )
    call = response.output[1]
    items += [
        *response.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    reply("Sunny.")
    answer = client.responses.create(
        model=api.MODEL_NAME, input=items, tools=[WEATHER], store=False
    )
    assert answer.output_text == "Sunny."
    prompt = submitted_prompt(api)
    turns = prompt.split("<|im_start|>")
    assert turns[-3:] == [
        'assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call><|im_end|>\n",
        "user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n",
        "assistant\n",
    ]


def test_streamed_function_call_matches_the_whole(
    api: ApiHarness, client: openai.OpenAI, reply
) -> None:
    reply(CALL_TEXT)
    events = list(
        client.responses.create(
            model=api.MODEL_NAME, input="Weather?", tools=[WEATHER], stream=True
        )
    )
    types = [event.type for event in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == done.arguments


def test_named_tool_choice_forces_the_call(api: ApiHarness, client: openai.OpenAI, reply) -> None:
    reply('{"city": "Oslo"}')
    response = client.responses.create(
        model=api.MODEL_NAME,
        input="Weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    [call] = response.output
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    expected = StructuredOutput("json_schema", json.dumps(PARAMETERS, separators=(",", ":")))
    assert api.scheduler.submitted[-1].structured_output == expected


def test_reasoning_becomes_a_reasoning_item(
    api: ApiHarness, client: openai.OpenAI, reply, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = api.app.state.server
    monkeypatch.setattr(
        state, "config", dataclasses.replace(state.config, reasoning_parser="qwen3")
    )
    reply("<think>Maybe Paris.</think>Paris.")
    whole = client.responses.create(model=api.MODEL_NAME, input="Capital?")
    reasoning, _ = whole.output
    assert (reasoning.type, reasoning.content[0].text) == ("reasoning", "Maybe Paris.")
    assert reasoning.id.startswith("rs_")
    assert whole.output_text == "Paris."
    events = list(client.responses.create(model=api.MODEL_NAME, input="Capital?", stream=True))
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Maybe Paris."
    streamed = events[-1].response.output
    assert [item.model_dump(exclude={"id"}) for item in streamed] == [
        item.model_dump(exclude={"id"}) for item in whole.output
    ]
    # An answer given back as input leaves its reasoning out of the prompt.
    client.responses.create(model=api.MODEL_NAME, input="And Italy?", previous_response_id=whole.id)
    assert "Maybe Paris." not in submitted_prompt(api)


HOSTILE = [
    ({"input": "x", "foo": 1}, 400, "foo", "Unknown parameter: 'foo'."),
    ({"input": "x", "text": {"format": {"type": "text"}, "mood": 1}}, 400, "text.mood", None),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", None),
    ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata", None),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, 400, "metadata", None),
    ({"input": "x", "previous_response_id": "resp_../etc"}, 400, "previous_response_id", None),
    ({"input": "x", "previous_response_id": "resp_" + "0" * 32}, 404, "previous_response_id", None),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type", None),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, 400, "tool_choice", None),
    ({"input": "x", "background": True}, 400, "background", None),
    ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning.effort", None),
    ({"input": "x", "include": ["file_search_call.results"]}, 400, "include", None),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation", None),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0]", None),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        400,
        "input[0].content[0]",
        None,
    ),
    ({"input": [{"role": "user", "content": "x", "mood": 1}]}, 400, "input[0].mood", None),
    (
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": 5}}},
        },
        400,
        "text.format",
        None,
    ),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, 400, "tools[1].name", None),
    ({"input": "x", "model": "other"}, 404, "model", None),
    ({"input": "x", "model": "other", "background": True}, 404, "model", None),
    ({}, 400, "input", "Missing required parameter: 'input'."),
    ({"input": "x" * 2_000_000}, 400, "input", None),
    (
        {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}]},
        400,
        "input",
        "input: images are only allowed in user messages",
    ),
    ({"input": []}, 400, "input", None),
]


def test_hostile_requests_fail_alone_beside_an_innocent_stream(
    api: ApiHarness, http: httpx.Client
) -> None:
    api.scheduler.step_interval_s = 0.01
    with (
        httpx.Client(base_url=api.url, timeout=10) as innocent,
        innocent.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True}) as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines) == "event: response.created"
        for body, status, param, message in HOSTILE:
            answer = http.post("/v1/responses", json=body)
            assert answer.status_code == status, (body, answer.text)
            error = answer.json()["error"]
            assert error["param"] == param, (body, error)
            if message is not None:
                assert error["message"] == message
        for path in ("/v1/responses/resp_x", "/v1/responses/" + "a" * 300):
            assert http.get(path).status_code == 400
            assert http.delete(path).status_code == 400
        assert http.get("/v1/responses/resp_" + "f" * 32).status_code == 404
        rest = "\n".join(lines)
    data = [
        json.loads(line.removeprefix("data: "))
        for line in rest.split("\n")
        if line.startswith("data: ")
    ]
    assert data[-1]["type"] == "response.completed"
    assert data[-1]["response"]["output"][0]["content"][0]["text"] == REPLY


def test_error_mid_stream_ends_with_response_failed(api: ApiHarness, http: httpx.Client) -> None:
    api.scheduler.fail_with = "the worker died"
    api.scheduler.fail_after_tokens = 2
    events = sse_events(http.post("/v1/responses", json={"input": "Hi", "stream": True}))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "the worker died"
    assert events[-1]["response"]["error"]["code"] == "server_error"


def test_a_client_that_leaves_aborts_the_generation(api: ApiHarness) -> None:
    api.scheduler.repeat = True
    with (
        httpx.Client(base_url=api.url, timeout=10) as leaving,
        leaving.stream("POST", "/v1/responses", json={"input": "Hi", "stream": True}) as stream,
    ):
        lines = stream.iter_lines()
        while "output_text.delta" not in next(lines):
            pass
    request_id = api.scheduler.submitted[-1].request_id
    assert api.scheduler.wait_for(lambda: request_id in api.scheduler.aborted)


def test_a_store_that_cannot_be_used_fails_only_requests_that_need_it(
    api: ApiHarness, http: httpx.Client, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    working = api.app.state.response_store
    api.app.state.response_store = ResponseStore(ResponseStoreConfig(str(blocker / "store")))
    num_submitted = len(api.scheduler.submitted)
    try:
        answer = http.post("/v1/responses", json={"input": "Hi"})
        assert answer.status_code == 503
        assert str(blocker / "store") in answer.json()["error"]["message"]
        assert len(api.scheduler.submitted) == num_submitted  # refused before generating
        unstored = http.post("/v1/responses", json={"input": "Hi", "store": False})
        assert unstored.status_code == 200
        assert http.get("/v1/responses/resp_" + "1" * 32).status_code == 503
    finally:
        api.app.state.response_store.close()
        api.app.state.response_store = working
    assert http.post("/v1/responses", json={"input": "Hi"}).status_code == 200


def test_a_store_write_that_fails_keeps_the_output_unstored(
    api: ApiHarness, http: httpx.Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The conversation fits the store, the finished response does not: the client still gets
    its output, whole or streamed, as a completed response with ``store: false`` (it cannot be
    retrieved or continued), and the failure is logged."""
    working = api.app.state.response_store
    tiny = ResponseStoreConfig(str(tmp_path), max_mb=600 / (1024 * 1024))
    api.app.state.response_store = ResponseStore(tiny)
    try:
        with caplog.at_level(logging.WARNING, logger="api_server.open_responses"):
            answer = http.post("/v1/responses", json={"input": "Hi"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["status"], body["store"]) == ("completed", False)
        assert body["output"][0]["content"][0]["text"] == REPLY
        assert f"response {body['id']} was not stored" in caplog.text
        assert "more than a row may (600; --responses-store-max-mb)" in caplog.text
        assert http.get(f"/v1/responses/{body['id']}").status_code == 404
        events = sse_events(http.post("/v1/responses", json={"input": "Hi", "stream": True}))
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["store"] is False
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == REPLY
    finally:
        api.app.state.response_store.close()
        api.app.state.response_store = working


def test_store_flags(default_model_dir: Path, tmp_path: Path, capsys) -> None:
    from api_server.__main__ import build_config, parse_args

    args = ["--model", str(default_model_dir), "--scheduler-addr", "ipc://s"]
    store = ["--responses-store-dir", "relative", "--responses-store-max-age-days", "0.5"]
    config = build_config(parse_args([*args, *store, "--responses-store-max-mb", "2"]))
    assert config.responses_store == ResponseStoreConfig(str(Path("relative").absolute()), 0.5, 2)
    assert config.responses_store.path == Path("relative").absolute() / "responses.sqlite3"
    with pytest.raises(SystemExit):
        parse_args([*args, "--responses-store-max-mb", "0"])
    assert "argument --responses-store-max-mb: must be above 0, got 0" in capsys.readouterr().err


# The store itself.


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def new_store(tmp_path: Path, **options) -> tuple[ResponseStore, Clock]:
    clock = Clock()
    return ResponseStore(ResponseStoreConfig(str(tmp_path), **options), clock), clock


def test_store_round_trip_and_sharing(tmp_path: Path) -> None:
    store, _ = new_store(tmp_path)
    other, _ = new_store(tmp_path)
    run(store.put("resp_1", '{"a": 1}', "[]"))
    assert run(other.get("resp_1")).response == '{"a": 1}'
    assert run(other.delete("resp_1")) is True
    assert run(store.get("resp_1")) is None
    assert run(store.delete("resp_1")) is False
    run(store.put("resp_2", "{}", "[]"))
    store.close()
    other.close()
    restarted, _ = new_store(tmp_path)
    assert run(restarted.get("resp_2")) == StoredResponse("{}", "[]")
    restarted.close()


def test_store_forgets_by_age(tmp_path: Path) -> None:
    store, clock = new_store(tmp_path, max_age_days=1.0)
    run(store.put("resp_old", "{}", "[]"))
    clock.now += 12 * 3600
    run(store.put("resp_new", "{}", "[]"))
    clock.now += 13 * 3600
    assert run(store.get("resp_old")) is None  # expired, even before eviction
    assert run(store.get("resp_new")) is not None
    run(store.put("resp_newest", "{}", "[]"))
    rows = sqlite3.connect(store.config.path).execute("SELECT id FROM responses ORDER BY id")
    assert [row[0] for row in rows] == ["resp_new", "resp_newest"]
    store.close()


def test_store_forgets_the_oldest_beyond_its_size(tmp_path: Path) -> None:
    store, clock = new_store(tmp_path, max_mb=1000 / (1024 * 1024))  # 1000 bytes
    for index in range(4):
        clock.now += 1
        run(store.put(f"resp_{index}", "x" * 298, "[]"))  # 300 bytes each
    kept = [index for index in range(4) if run(store.get(f"resp_{index}")) is not None]
    assert kept == [1, 2, 3]
    with pytest.raises(StoreUnavailable, match="more than a row may"):
        run(store.put("resp_big", "x" * 1000, "[]"))
    store.close()


def test_a_corrupt_store_fails_each_use_and_recovers(tmp_path: Path) -> None:
    store, _ = new_store(tmp_path)
    store.config.path.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreUnavailable, match="cannot be used"):
        run(store.get("resp_1"))
    store.config.path.unlink()
    run(store.put("resp_1", "{}", "[]"))
    assert run(store.get("resp_1")) is not None
    store.close()


def test_a_corrupt_row_is_a_500(api: ApiHarness, http: httpx.Client) -> None:
    created = http.post("/v1/responses", json={"input": "Hi"}).json()
    path = api.app.state.response_store.config.path
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE responses SET response = '{}' WHERE id = ?", (created["id"],))
    answer = http.get(f"/v1/responses/{created['id']}")
    assert answer.status_code == 500
    assert answer.json()["error"]["message"] == f"The stored response {created['id']} is unreadable"
    follow_up = http.post(
        "/v1/responses", json={"input": "x", "previous_response_id": created["id"]}
    )
    assert follow_up.status_code == 500
