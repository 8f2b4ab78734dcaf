"""HTTP clients the end-to-end tests share: a request in a background thread, a slow reader
that backs up the server's writes, bounded polling, and a free loopback port."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx


@dataclass
class Outcome:
    """What one client saw: status, SSE data lines (or the JSON body), when it ended."""

    status: int | None = None
    events: list[dict] = field(default_factory=list)
    body: dict | None = None
    error: str | None = None
    ended_at: float | None = None
    first_event: threading.Event = field(default_factory=threading.Event)

    @property
    def finish_reasons(self) -> list[str]:
        return [
            choice["finish_reason"]
            for event in self.events
            for choice in event.get("choices", [])
            if choice.get("finish_reason")
        ]


def in_background(base_url: str, body: dict) -> tuple[Outcome, threading.Thread]:
    """Send ``body`` to /v1/chat/completions in a thread; the Outcome fills as it runs."""
    outcome = Outcome()

    def run() -> None:
        try:
            with (
                httpx.Client(timeout=60) as http,
                http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
            ):
                outcome.status = response.status_code
                if not body.get("stream"):
                    outcome.body = json.loads(response.read())
                    return
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        outcome.events.append(json.loads(line[len("data: ") :]))
                        outcome.first_event.set()
        except httpx.HTTPError as error:
            outcome.error = repr(error)
        finally:
            outcome.ended_at = time.monotonic()
            outcome.first_event.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return outcome, thread


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def health_status(base_url: str, path: str = "/health") -> int | None:
    try:
        return httpx.get(f"{base_url}{path}", timeout=1).status_code
    except httpx.HTTPError:
        return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SlowReader:
    """A streaming request over a raw socket with a tiny receive buffer that reads nothing
    until ``read_all()``: the server's writes to it back up.

    ``max_segment`` (bytes) shrinks the TCP segments too: loopback's 64 KiB segments let the
    server's socket buffer grow to megabytes; with 536-byte ones it stays near 100 KB, so the
    server's writes back up after a few steps."""

    def __init__(self, base_url: str, body: dict, max_segment: int | None = None) -> None:
        parts = urlsplit(base_url)
        self.socket = socket.socket()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        if max_segment is not None:
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, max_segment)
        self.socket.connect((parts.hostname, parts.port))
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n"
        )
        self.socket.sendall(head.encode() + payload)

    def read_all(self) -> list[dict]:
        """Every SSE data event of the response, read to the end."""
        self.socket.settimeout(60)
        chunks = []
        while chunk := self.socket.recv(65536):
            chunks.append(chunk)
        self.socket.close()
        text = b"".join(chunks).decode()
        return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
