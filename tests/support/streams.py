"""Mixed chat streams run once undisturbed and again across a fault (a process killed or
stopped), compared token for token: what the fault tests of tests/e2e and tests/deploy share."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.clients import wait_until
from tests.support.serve_process import DEFAULT_MODEL_NAME, chat_messages

MAX_TOKENS = 24
FIRST_TOKENS = 3
"""Tokens every stream has (or it has ended) before the fault."""
LOGPROB_TOLERANCE = 1e-3
"""Recomputed logits come from another batch shape and a prefill instead of decode steps."""
TOPICS = ("Paris", "the sea", "a dragon", "bread", "the moon", "trains", "a violin", "winter")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def mixed_request(index: int) -> dict:
    """One of seven kinds by ``index``: greedy, seeded sampling, json_schema, n=2, logprobs with
    top_logprobs, a stop string, min_tokens; each asks about its own topic."""
    topic = TOPICS[index % len(TOPICS)]
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": chat_messages(f"Tell me about {topic}."),
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    seeded = {"temperature": 0.8, "seed": 1000 + index}
    kind = index % 7
    if kind == 1:
        body |= seeded
    elif kind == 2:
        body |= seeded
        body["messages"] = chat_messages(f"Describe a person who likes {topic}, as JSON.")
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        }
    elif kind == 3:
        body |= seeded | {"n": 2}
    elif kind == 4:
        body |= seeded | {"logprobs": True, "top_logprobs": 5}
    elif kind == 5:
        body["stop"] = [" and"]
    elif kind == 6:
        body["messages"] = chat_messages(f"Say only the word {topic}.")
        body["min_tokens"] = MAX_TOKENS - 4
    return body


@dataclass
class Stream:
    """What one streaming client saw: the data events with their arrival times."""

    status: int | None = None
    events: list[tuple[float, dict]] = field(default_factory=list)
    done: bool = False
    """It ended with ``data: [DONE]``."""
    error: str | None = None
    ended: threading.Event = field(default_factory=threading.Event)

    @property
    def num_tokens(self) -> int:
        return sum(
            1
            for _, event in self.events
            for choice in event.get("choices", [])
            if choice["delta"].get("content")
        )

    def summary(self) -> dict:
        """Per choice: text, finish reason, logprob tokens (and their values apart, compared
        within a tolerance); and the usage's completion tokens."""
        choices: dict[int, dict] = {}
        usage = None
        for _, event in self.events:
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                mine = choices.setdefault(
                    choice["index"], {"text": "", "finish_reason": None, "tokens": []}
                )
                mine["text"] += choice["delta"].get("content") or ""
                mine["finish_reason"] = choice["finish_reason"] or mine["finish_reason"]
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    top = [alternative["token"] for alternative in entry["top_logprobs"]]
                    mine["tokens"].append((entry["token"], top))
        completion_tokens = usage["completion_tokens"] if usage else None
        return {"choices": choices, "completion_tokens": completion_tokens}

    def logprob_values(self) -> list[float]:
        return [
            value
            for _, event in self.events
            for choice in event.get("choices", [])
            for entry in (choice.get("logprobs") or {}).get("content") or []
            for value in (entry["logprob"], *(a["logprob"] for a in entry["top_logprobs"]))
        ]


def open_stream(base_url: str, body: dict, headers: dict[str, str] | None = None) -> Stream:
    """``body`` streamed from ``/v1/chat/completions`` on a thread of its own."""
    stream = Stream()

    def run() -> None:
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=180), headers=headers) as http,
                http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
            ):
                stream.status = response.status_code
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        stream.done = True
                    elif line.startswith("data: {"):
                        stream.events.append((time.monotonic(), json.loads(line[6:])))
        except httpx.HTTPError as error:
            stream.error = repr(error)
        finally:
            stream.ended.set()

    threading.Thread(target=run, daemon=True).start()
    return stream


def run_all(
    base_url: str,
    bodies: list[dict],
    timeout_s: float = 240,
    headers: dict[str, str] | None = None,
) -> list[Stream]:
    streams = [open_stream(base_url, body, headers) for body in bodies]
    assert all(stream.ended.wait(timeout_s) for stream in streams)
    return streams


def all_started(streams: list[Stream]) -> bool:
    """Every stream has ``FIRST_TOKENS`` tokens or has ended."""
    return all(s.num_tokens >= FIRST_TOKENS or s.ended.is_set() for s in streams)


def run_with_fault(
    base_url: str,
    bodies: list[dict],
    fault,
    timeout_s: float = 240,
    when=all_started,
    max_delay_s: float = 0.5,
    headers: dict[str, str] | None = None,
) -> tuple[list[Stream], float, list[bool]]:
    """``bodies`` streamed at once; ``fault()`` once ``when(streams)`` holds (by default
    ``all_started``), after a random delay of up to ``max_delay_s``. Returns the streams, when
    the fault happened and which streams were still open then."""
    streams = [open_stream(base_url, body, headers) for body in bodies]
    assert wait_until(lambda: when(streams), 120, interval_s=0.02)
    time.sleep(random.uniform(0, max_delay_s))
    open_then = [not stream.ended.is_set() for stream in streams]
    faulted_at = time.monotonic()
    fault()
    assert all(stream.ended.wait(timeout_s) for stream in streams)
    return streams, faulted_at, open_then


def assert_same_as_undisturbed(streams: list[Stream], undisturbed: list[Stream]) -> None:
    for index, (stream, alone) in enumerate(zip(streams, undisturbed, strict=True)):
        assert (stream.status, stream.error, stream.done) == (200, None, True), index
        assert not any("error" in event for _, event in stream.events), stream.events[-1]
        assert stream.summary() == alone.summary(), index
        assert stream.logprob_values() == pytest.approx(
            alone.logprob_values(), abs=LOGPROB_TOLERANCE
        )


def pauses(streams: list[Stream], faulted_at: float, open_then: list[bool]) -> list[float]:
    """For each stream open at the fault: seconds from the fault to its next event."""
    return [
        min(at for at, _ in stream.events if at > faulted_at) - faulted_at
        for stream, was_open in zip(streams, open_then, strict=True)
        if was_open
    ]


def report(what: str, measured: list[float]) -> None:
    print(
        f"{what}: pause from the fault to the next token over {len(measured)} streams: "
        f"median {statistics.median(measured):.1f} s, max {max(measured):.1f} s"
    )
