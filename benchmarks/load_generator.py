"""An async load generator for an OpenAI-compatible ``/v1/completions`` endpoint.

Each request streams (SSE) a completion of exactly ``output_len`` tokens for a token-id prompt;
the client records when each text chunk arrives. At most ``concurrency`` requests are in flight;
with a finite ``request_rate`` they also arrive as a Poisson process (exponential gaps), as in
vLLM's benchmark_serving.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
from workload import BenchmarkError


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds; ``error`` is empty on success."""

    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    time_to_first_token: float = 0.0
    inter_token_latencies: list[float] = field(default_factory=list)
    latency: float = 0.0
    """Request sent to ``[DONE]`` received."""
    text: str = ""
    """The generated text, as streamed (what a chat client appends to its conversation)."""

    @property
    def success(self) -> bool:
        return not self.error


def new_client(base_url: str, concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """A client with one connection per concurrent request. ``timeout_s`` bounds each read, so a
    server that stops answering fails its requests instead of hanging the benchmark."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=limits,
        trust_env=False,  # a proxy from the environment would distort every latency
    )


async def served_model(client: httpx.AsyncClient) -> dict:
    """The first entry of ``GET /v1/models`` (Switchyard serves one model per server)."""
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        models = response.json()["data"]
    except httpx.HTTPError as error:
        raise BenchmarkError(f"server at {client.base_url} is unreachable: {error!r}") from None
    except (ValueError, KeyError) as error:
        raise BenchmarkError(f"{client.base_url}/v1/models answered oddly: {error!r}") from None
    if not models:
        raise BenchmarkError(f"{client.base_url}/v1/models lists no model")
    return models[0]


def completion_payload(
    model: str,
    prompt: list[int],
    output_len: int,
    temperature: float = 0.0,
    top_p: float | None = None,
) -> dict:
    """A streaming completion of ``prompt``, exactly ``output_len`` tokens; greedy unless
    ``temperature`` (and ``top_p``, not sent when None) say otherwise."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": temperature,
        **({} if top_p is None else {"top_p": top_p}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_payload(model: str, messages: list[dict], output_len: int) -> dict:
    """``completion_payload`` for /v1/chat/completions: ``messages`` in place of the prompt."""
    payload = completion_payload(model, [], output_len)
    del payload["prompt"]
    return {**payload, "messages": messages}


async def stream_completion(client: httpx.AsyncClient, payload: dict) -> RequestResult:
    """Send one streaming completion (a chat completion when ``payload`` has ``messages``);
    never raises, failures land in ``RequestResult.error``. A chat prompt's length is the
    server's count (its template adds tokens); a completion's must equal the ids sent."""
    result = RequestResult()
    start = time.perf_counter()
    path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
    try:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {_error_message(body)}"
                return result
            await _read_events(response, start, result)
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {str(error) or 'connection lost'}"
    except (ValueError, KeyError, TypeError) as error:
        result.error = f"malformed stream: {error!r}"
    result.latency = time.perf_counter() - start
    if not result.error:
        input_len = len(payload["prompt"]) if "prompt" in payload else result.prompt_tokens
        result.error = _check_lengths(result, input_len, payload["max_tokens"])
    return result


async def _read_events(response: httpx.Response, start: float, result: RequestResult) -> None:
    """Fill ``result`` from the SSE lines of ``response`` until ``[DONE]``."""
    last_text_time: float | None = None
    async for line in response.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"error event: {_error_message(data)}"
            return
        texts = [_text(choice) for choice in chunk.get("choices") or []]
        if any(texts):
            result.text += "".join(texts)
            if last_text_time is None:
                result.time_to_first_token = now - start
            else:
                result.inter_token_latencies.append(now - last_text_time)
            last_text_time = now
        if chunk.get("usage"):
            result.prompt_tokens = chunk["usage"]["prompt_tokens"]
            result.output_tokens = chunk["usage"]["completion_tokens"]
    result.error = "stream ended without [DONE]"


def _text(choice: dict) -> str:
    """The text a completion's or a chat completion's streamed choice carries ('' if none)."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _check_lengths(result: RequestResult, input_len: int, output_len: int) -> str:
    """An error message when the server did not do what was asked, else ''."""
    if result.output_tokens == 0:
        return "no usage chunk in the stream"
    if not result.time_to_first_token:
        return "no text in the stream"
    if result.prompt_tokens != input_len:
        return f"prompt counted as {result.prompt_tokens} tokens, sent {input_len}"
    if result.output_tokens != output_len:
        return f"{result.output_tokens} output tokens, asked for {output_len}"
    return ""


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200]


async def run_load(
    client: httpx.AsyncClient,
    payloads: list[dict],
    concurrency: int,
    request_rate: float,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """Send every payload; return the results (in payload order) and the wall time in seconds."""
    semaphore = asyncio.Semaphore(concurrency)
    arrival_gaps = random.Random(seed)
    progress = _Progress(len(payloads))

    async def limited(payload: dict) -> RequestResult:
        async with semaphore:
            result = await stream_completion(client, payload)
        progress.done(result)
        return result

    start = time.perf_counter()
    tasks = []
    for payload in payloads:
        tasks.append(asyncio.create_task(limited(payload)))
        if not math.isinf(request_rate):
            await asyncio.sleep(arrival_gaps.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


class _Progress:
    """Prints ``completed k/n`` to stderr about ten times per run."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.finished = 0
        self.failed = 0
        self.step = max(1, total // 10)

    def done(self, result: RequestResult) -> None:
        self.finished += 1
        self.failed += not result.success
        if self.finished % self.step == 0 or self.finished == self.total:
            failed = f" ({self.failed} failed)" if self.failed else ""
            print(f"  completed {self.finished}/{self.total}{failed}", file=sys.stderr, flush=True)
