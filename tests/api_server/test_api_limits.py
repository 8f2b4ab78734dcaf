"""Request limits (api_server.limits): a body above the limit is a 413 whether it names its
length or not, too many or too large header fields a 431, with small limits so tests are fast;
their flags; and the request bounds that are plain 400s (``n``, ``max_tokens``)."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from api_server.__main__ import build_config, parse_args
from api_server.config import HttpLimits
from api_server.limits import RequestLimitsMiddleware, uvicorn_options
from tests.support.fake_scheduler import ApiHarness

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
ORIGIN = "https://app.example"
LIMITS = HttpLimits(max_request_body_bytes=1024, max_header_count=20, max_header_bytes=2048)
BODY_TOO_LARGE = {
    "message": "The request body is larger than the limit of 1024 bytes",
    "type": "invalid_request_error",
    "param": None,
    "code": "request_too_large",
}
NOT_JSON = "The request body is not valid JSON: "
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An API server with LIMITS and CORS for ORIGIN."""
    harness = ApiHarness(
        default_model_dir,
        tmp_path_factory.mktemp("api-limits"),
        allowed_origins=(ORIGIN,),
        limits=LIMITS,
    )
    harness.scheduler.reply = [19556, 905]
    harness.scheduler.eos_token_id = 2
    yield harness
    harness.close()


def chunks(num_chunks: int, size: int = 512) -> Iterator[bytes]:
    """A body httpx sends chunked (no Content-Length)."""
    for _ in range(num_chunks):
        yield b"x" * size


def raw_get(url: str, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """GET /v1/models with exactly ``headers`` (httpx would add its own); status and JSON."""
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=10)
    try:
        connection.putrequest("GET", "/v1/models", skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_content_length_over_the_limit_is_413(api: ApiHarness, client: httpx.Client) -> None:
    num_submitted = len(api.scheduler.submitted)
    response = client.post(CHAT, content=b"x" * 1025)
    assert (response.status_code, response.json()) == (413, {"error": BODY_TOO_LARGE})
    assert response.headers["connection"] == "close"
    assert len(api.scheduler.submitted) == num_submitted


def test_a_chunked_body_over_the_limit_is_413(api: ApiHarness, client: httpx.Client) -> None:
    num_submitted = len(api.scheduler.submitted)
    response = client.post(CHAT, content=chunks(3), headers=JSON)
    assert "content-length" not in response.request.headers
    assert (response.status_code, response.json()) == (413, {"error": BODY_TOO_LARGE})
    assert len(api.scheduler.submitted) == num_submitted
    assert client.post(CHAT, json={"messages": MESSAGES}).status_code == 200


@pytest.mark.parametrize("body", [b"x" * 1024, chunks(2)], ids=["content-length", "chunked"])
def test_a_body_at_the_limit_reaches_the_app(client: httpx.Client, body) -> None:
    response = client.post(CHAT, content=body, headers=JSON)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(NOT_JSON)


def test_a_chat_completion_at_the_limit(client: httpx.Client) -> None:
    body = json.dumps({"messages": MESSAGES}).ljust(1024).encode()
    response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"


def test_a_413_carries_cors_headers(client: httpx.Client) -> None:
    response = client.post(CHAT, content=b"x" * 2000, headers={"origin": ORIGIN})
    assert response.status_code == 413
    assert response.headers["access-control-allow-origin"] == ORIGIN


def test_header_count_limit(api: ApiHarness) -> None:
    headers = [("host", "x")] + [(f"x-h{i}", "v") for i in range(19)]
    assert raw_get(api.url, headers)[0] == 200
    status, body = raw_get(api.url, [*headers, ("x-h19", "v")])
    assert (status, body["error"]) == (
        431,
        {
            "message": "The request has 21 header fields, more than the limit of 20",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_header_fields_too_large",
        },
    )


def test_header_bytes_limit(api: ApiHarness) -> None:
    headers = [("host", "x"), ("x-pad", "a" * (2048 - 5 - 5))]
    assert raw_get(api.url, headers)[0] == 200
    status, body = raw_get(api.url, [*headers[:1], ("x-pad", "a" * (2049 - 5 - 5))])
    assert (status, body["error"]["code"]) == (431, "request_header_fields_too_large")
    assert body["error"]["message"] == (
        "The request's header fields take 2049 bytes, more than the limit of 2048 bytes"
    )


def run_middleware(headers: list[tuple[bytes, bytes]], body: list[bytes]):
    """Drive RequestLimitsMiddleware(LIMITS) around an app that reads the whole body and then
    answers 200; returns (what the app received, what was sent)."""
    received: list[dict] = []
    sent: list[dict] = []
    incoming = [
        {"type": "http.request", "body": chunk, "more_body": index < len(body) - 1}
        for index, chunk in enumerate(body)
    ]

    async def app(scope, receive, send) -> None:
        while not received or received[-1].get("more_body"):
            received.append(await receive())
            if received[-1]["type"] == "http.disconnect":
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    asyncio.run(RequestLimitsMiddleware(app, LIMITS)(scope, receive, send))
    return received, sent


def test_a_chunked_body_over_the_limit_ends_in_a_disconnect() -> None:
    received, sent = run_middleware([], [b"a" * 600, b"b" * 600, b"c"])
    assert [(message["type"], len(message.get("body", b""))) for message in received] == [
        ("http.request", 600),
        ("http.disconnect", 0),
    ]
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 413
    assert (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"]) == {"error": BODY_TOO_LARGE}


@pytest.mark.parametrize("value", [b"-5", b"abc", b"1e3", b""])
def test_an_invalid_content_length_is_400(value: bytes) -> None:
    received, sent = run_middleware([(b"content-length", value)], [b""])
    assert received == []
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["message"] == (
        f"Content-Length must be a non-negative integer, got {value.decode()!r}"
    )


def test_headers_at_the_limits_pass() -> None:
    headers = [(b"x-h%02d" % i, b"") for i in range(19)] + [(b"x-pad", b"a" * (2048 - 95 - 5))]
    received, sent = run_middleware(headers, [b"a" * 1024])
    assert (len(received), sent[0]["status"]) == (1, 200)
    headers[-1] = (b"x-pad", b"a" * (2049 - 95 - 5))
    assert run_middleware(headers, [b""])[1][0]["status"] == 431


def test_http_limits_take_their_flags_or_defaults_and_refuse_zero(default_model_dir: Path) -> None:
    required = ["--model", str(default_model_dir), "--scheduler-addr", "ipc://s"]
    assert build_config(parse_args(required)).limits == HttpLimits(33554432, 100, 65536)
    flags = ["--max-request-body-bytes", "1000", "--max-header-count", "5"]
    args = parse_args([*required, *flags, "--max-header-bytes", "600"])
    assert build_config(args).limits == HttpLimits(1000, 5, 600)
    with pytest.raises(ValueError) as raised:
        build_config(parse_args([*required, "--max-header-bytes", "0"]))
    assert str(raised.value) == "max_header_bytes must be a positive integer, got 0"


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_nonsense_limits_are_refused(value) -> None:
    with pytest.raises(ValueError) as raised:
        HttpLimits(max_request_body_bytes=value)
    assert str(raised.value) == f"max_request_body_bytes must be a positive integer, got {value!r}"


def test_uvicorn_options_cover_the_header_limits() -> None:
    assert uvicorn_options(HttpLimits()) == {"h11_max_incomplete_event_size": 65536 + 400 + 8192}


def test_n_above_the_maximum_is_400(client: httpx.Client) -> None:
    response = client.post(CHAT, json={"messages": MESSAGES, "n": 129})
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["message"]) == (
        "n",
        "n: Input should be less than or equal to 128",
    )


def test_max_tokens_above_the_context_length_is_400(api: ApiHarness, client: httpx.Client) -> None:
    num_prompt_tokens = len(api.tokenizer.encode_now("x"))
    fits = 256 - num_prompt_tokens
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": fits})
    assert ok.status_code == 200
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": fits + 1})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "This model's maximum context length is 256 tokens. However, you requested "
        f"257 tokens ({num_prompt_tokens} in the prompt, {fits + 1} for the completion). Please "
        "reduce the length of the prompt or of the completion.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    chat = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 256})
    assert (chat.status_code, chat.json()["error"]["param"]) == (400, "messages")
