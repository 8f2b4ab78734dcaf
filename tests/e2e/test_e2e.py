"""End to end: `switchyard serve` with the default model, driven by the official openai client."""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import time

import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from api_server.stats_tickets import STATS_MAX_AGE_S
from tests.support.metrics import scrape
from tests.support.serve_process import ServeProcess, alive, chat_messages, long_chat

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about trains.",
    "List three primary colors.",
]


NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'  # noqa: E501
"""This server decodes speculatively, so every parity test here checks that drafts change no
token (the other end-to-end servers decode one token at a time)."""


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("e2e") / "serve.log"
    serve = ServeProcess(
        "--api-servers", "2", "--log-format", "json", "--speculative-config", NGRAM,
        log_path=log_path,
    )  # fmt: skip
    yield serve
    serve.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """transformers' greedy generation on the same model, the parity reference."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()

    def generate(input_ids: list[int], max_new_tokens: int, **options) -> list[int]:
        # An explicit mask: chat prompts contain <|im_end|>, the pad token, which generate()
        # would otherwise mask out of the prompt.
        with torch.inference_mode():
            output = model.generate(
                torch.tensor([input_ids]),
                attention_mask=torch.ones(1, len(input_ids), dtype=torch.int64),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.eos_token_id,
                **options,
            )
        return output[0, len(input_ids) :].tolist()

    def chat(prompt: str, max_new_tokens: int = 32, **options) -> tuple[str, int]:
        messages = [{"role": "user", "content": prompt}]
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        tokens = generate(list(input_ids), max_new_tokens, **options)
        return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)

    def complete(prompt: str, max_new_tokens: int = 32, **options) -> tuple[str, int]:
        """Greedy text and token count; ``options`` go to ``generate`` (penalties, biases)."""
        tokens = generate(tokenizer.encode(prompt), max_new_tokens, **options)
        return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)

    return chat, complete


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_chat_greedy_matches_transformers(client, reference, prompt):
    expected_text, expected_count = reference[0](prompt)
    response = client.chat.completions.create(
        model=MODEL, messages=chat_messages(prompt), max_tokens=32, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text
    assert choice.finish_reason == ("length" if expected_count == 32 else "stop")
    assert response.usage.completion_tokens == expected_count
    assert response.usage.total_tokens == response.usage.prompt_tokens + expected_count
    assert response.model == MODEL


def test_completion_greedy_matches_transformers(client, reference):
    prompt = "The three laws of robotics are"
    expected_text, expected_count = reference[1](prompt, 24)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert response.choices[0].text == expected_text
    assert response.usage.completion_tokens == expected_count


REPETITIVE_PROMPT = "List the colors: red, blue, red, blue, red,"


def test_repetition_penalty_matches_transformers(client, reference):
    expected_text, _ = reference[1](REPETITIVE_PROMPT, 24, repetition_penalty=1.5)
    plain_text, _ = reference[1](REPETITIVE_PROMPT, 24)
    assert expected_text != plain_text  # the penalty changes this output
    response = client.completions.create(
        model=MODEL,
        prompt=REPETITIVE_PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"repetition_penalty": 1.5},
    )
    assert response.choices[0].text == expected_text


def test_drafts_are_verified_and_change_no_token(server, client, reference):
    def counts() -> tuple[float, float]:
        time.sleep(STATS_MAX_AGE_S + 0.1)  # a scheduler snapshot taken after the request
        samples = scrape(server.base_url)
        labels = frozenset({"model_name": MODEL}.items())
        return tuple(
            samples[(f"switchyard:spec_decode_num_{name}_total", labels)]
            for name in ("draft_tokens", "accepted_tokens")
        )

    drafted, accepted = counts()
    expected_text, _ = reference[1](REPETITIVE_PROMPT, 24)
    response = client.completions.create(
        model=MODEL, prompt=REPETITIVE_PROMPT, max_tokens=24, temperature=0
    )
    assert response.choices[0].text == expected_text
    now_drafted, now_accepted = counts()
    assert now_accepted > accepted  # red, blue, red, ... is drafted right
    assert now_drafted - drafted >= now_accepted - accepted


def test_logit_bias_and_min_tokens_match_transformers(client, reference, default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    plain_text, _ = reference[1](REPETITIVE_PROMPT, 8)
    banned = tokenizer.encode(plain_text)[0]
    expected_text, _ = reference[1](REPETITIVE_PROMPT, 8, sequence_bias={(banned,): -100.0})
    response = client.completions.create(
        model=MODEL,
        prompt=REPETITIVE_PROMPT,
        max_tokens=8,
        temperature=0,
        logit_bias={str(banned): -100},
    )
    assert response.choices[0].text == expected_text != plain_text
    # The chat answer to "Hi" ends early; min_tokens keeps EOS away as min_new_tokens does.
    _, count = reference[0]("Hi", 48)
    assert count < 40
    expected_text, expected_count = reference[0]("Hi", 48, min_new_tokens=40)
    response = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Hi"),
        max_tokens=48,
        temperature=0,
        extra_body={"min_tokens": 40},
    )
    assert response.choices[0].message.content == expected_text
    assert response.usage.completion_tokens == expected_count >= 40


def test_echo_returns_the_prompt_and_its_logprobs(client):
    prompt = "The capital of France is"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    num_tokens = response.usage.prompt_tokens + response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == num_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value <= 0 for value in logprobs.token_logprobs[1:])
    assert all(len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text


def test_choices_echo_the_same_prompt_logprobs_as_one_choice(client):
    """Only a prompt's first choice computes its log probabilities; every choice echoes them."""
    request = dict(
        model=MODEL, prompt="Paris is the capital of", max_tokens=0, echo=True, logprobs=2
    )
    alone = client.completions.create(**request).choices[0].logprobs
    choices = client.completions.create(**request, n=3).choices
    assert len(choices) == 3
    for choice in choices:
        assert choice.logprobs.tokens == alone.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-5)
        assert [sorted(top) if top else top for top in choice.logprobs.top_logprobs] == [
            sorted(top) if top else top for top in alone.top_logprobs
        ]


def test_streaming_chat_equals_non_streaming(client, reference):
    prompt = CHAT_PROMPTS[1]
    expected_text, _ = reference[0](prompt)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages(prompt),
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == expected_text
    assert [r for r in finish_reasons if r is not None] in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_streaming_completion(client, reference):
    prompt = "Once upon a time"
    expected_text, _ = reference[1](prompt, 16)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == expected_text


def test_64_concurrent_streams_over_two_api_servers_each_get_their_own_text(server, client):
    """Both API server processes serve some of them, every stream gets its own prompt's text
    (the same as that prompt's choice in one batched request, and as alone), and /metrics on
    either process counts each request once."""
    prompts = [f"Count from {i} to {i + 5}:" for i in range(64)]
    settings = {"model": MODEL, "max_tokens": 16, "temperature": 0, "echo": True}
    batched = client.completions.create(prompt=prompts, **settings)
    expected = {prompts[choice.index]: choice.text for choice in batched.choices}
    # Each text starts with its prompt (echo); nearly all continuations differ too, so a result
    # routed to the wrong stream would show.
    continuations = {text.removeprefix(prompt) for prompt, text in expected.items()}
    assert len(continuations) >= 56
    for prompt in prompts[:2] + prompts[-2:]:
        alone = client.completions.create(prompt=prompt, **settings)
        assert alone.choices[0].text == expected[prompt]
    finished_before = finished_requests(server)

    async def stream_one(async_client, prompt):
        stream = await async_client.completions.create(prompt=prompt, stream=True, **settings)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as async_client:
            return await asyncio.gather(*(stream_one(async_client, p) for p in prompts))

    texts = dict(zip(prompts, asyncio.run(run_all()), strict=True))
    assert texts == expected

    served_by = finished_streams_by_process(server.log_path, count=len(prompts))
    assert len(served_by) == 2 and all(served_by.values()), served_by
    for _ in range(4):  # the shared port hands each scrape to either process
        assert finished_requests(server) - finished_before == len(prompts)


def finished_requests(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "switchyard:request_success_total"
    )


def finished_streams_by_process(log_path, count: int) -> collections.Counter:
    """How many of the last ``count`` finished requests each API server process logged."""
    records = []
    for line in log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("role") == "api-server" and " finished (" in record.get("message", ""):
            records.append(record)
    return collections.Counter(record["process"] for record in records[-count:])


def test_a_dropped_stream_is_aborted_and_its_cache_freed(server):
    body = long_chat()
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or line == "" for line in received)
        # /metrics may come from the other API server, which shares stats fetched up to
        # STATS_MAX_AGE_S ago (before this request started, say): once that long has passed
        # since the first tokens, every API server's stats are from after the start.
        time.sleep(STATS_MAX_AGE_S)
        assert server.gauges()["num_requests_running"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gauges = server.gauges()
        if gauges["num_requests_running"] == 0 and gauges["kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.2)
    assert gauges == {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "messages": chat_messages("hi"), "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": "no-such-model", "messages": chat_messages("hi")}, 404, "model"),
        ({"model": MODEL, "messages": chat_messages("hi " * 9000)}, 400, "messages"),
        ({"model": MODEL, "messages": chat_messages("hi"), "max_tokens": 9000}, 400, "context"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert param in (error["param"] or "") + error["message"]


def test_malformed_json_gets_a_400(server):
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_same_seed_gives_the_same_text_even_beside_other_requests(server, client):
    def sample(seed):
        response = client.chat.completions.create(
            model=MODEL,
            messages=chat_messages("Invent a name for a cat."),
            max_tokens=16,
            temperature=1.0,
            seed=seed,
        )
        return response.choices[0].message.content

    async def sample_beside_others(seed):
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as async_client:
            others = [
                async_client.completions.create(
                    model=MODEL, prompt=f"Noise {i}", max_tokens=16, temperature=1.0
                )
                for i in range(3)
            ]
            await asyncio.gather(*others, asyncio.to_thread(sample, seed))
            return sample(seed)

    first = sample(1234)
    assert sample(1234) == first
    assert asyncio.run(sample_beside_others(1234)) == first


def test_chat_logprobs_have_the_requested_alternatives(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Say hello."),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_json_schema_output_parses_and_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Describe Paris as JSON."),
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    document = json.loads(response.choices[0].message.content)
    jsonschema.validate(document, schema)
    assert response.choices[0].finish_reason == "stop"


def test_guided_choice_answers_one_of_the_choices(client):
    choices = ["positive", "negative", "neutral"]
    response = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("Sentiment of 'I love trains'?"),
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": choices},
    )
    assert response.choices[0].message.content in choices
    assert response.choices[0].finish_reason == "stop"


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]


def test_named_tool_choice_calls_that_function_with_valid_arguments(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("What is the weather in Paris?"),
        max_tokens=48,
        temperature=0,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", None)
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_required_tool_choice_streams_calls_of_the_given_tools(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=chat_messages("What is the weather in Tokyo?"),
        max_tokens=96,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
    )
    calls, finish_reasons = {}, []
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        finish_reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert finish_reasons == ["tool_calls"]
    [call] = calls.values()
    assert call["name"] in ("get_weather", "get_time")
    parameters = WEATHER_PARAMETERS if call["name"] == "get_weather" else {"type": "object"}
    jsonschema.validate(json.loads(call["arguments"]), parameters)


def test_n_choices_share_one_prompt(client):
    response = client.chat.completions.create(
        model=MODEL, messages=chat_messages("Name a fruit."), max_tokens=8, temperature=0, n=3
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert len({choice.message.content for choice in response.choices}) == 1
    single = client.chat.completions.create(
        model=MODEL, messages=chat_messages("Name a fruit."), max_tokens=8, temperature=0
    )
    assert response.usage.prompt_tokens == single.usage.prompt_tokens
    assert response.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_models_and_health(server, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_every_process_shows_its_role(server):
    launcher = subprocess.run(
        ["ps", "-o", "args=", "-p", str(server.process.pid)], capture_output=True, text=True
    )
    assert launcher.stdout.strip() == "switchyard-launcher"
    titles = sorted(args for _, args in server.children())
    roles = [t for t in titles if t.startswith("switchyard-")]
    assert roles == [
        "switchyard-api-server",
        "switchyard-api-server",
        "switchyard-scheduler",
        "switchyard-worker tp0 hybrid",
    ]


def test_sigterm_stops_every_process_and_exits_zero(server):
    children = [pid for pid, _ in server.children()]
    assert server.terminate() == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.1)
    assert [pid for pid in children if alive(pid)] == []
