"""Request size limits for one API server (``HttpLimits``), checked before any route runs.

- More header fields than ``max_header_count``, or more than ``max_header_bytes`` of names plus
  values: 431. uvicorn's httptools parser has no header limit of its own, so this is the check;
  it runs once the header block is parsed (a reverse proxy is what stops a huge block earlier).
- A ``Content-Length`` above ``max_request_body_bytes``: 413 at once, before the body is read.
  One that is not a non-negative integer: 400.
- Whatever the ``Content-Length``, body bytes are counted as they stream (a chunked body names
  no length). Past the limit the middleware answers 413 itself, unless the app has already
  started a response, and the app's next ``receive`` gets ``http.disconnect``, so it never takes
  a truncated body for a whole one; whatever the app sends after the 413 is dropped.

A 413 or 431 carries ``Connection: close``: the server then stops reading the rest of the body
instead of discarding it for the next request on the connection.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_server.config import HttpLimits
from api_server.errors import OpenAIError, invalid_request

# h11 counts the request line and ": " plus CRLF per header too; allow for them.
_H11_REQUEST_LINE_BYTES = 8 * 1024
_H11_BYTES_PER_HEADER = 4


def body_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body is larger than the limit of {limit} bytes",
        "invalid_request_error",
        code="request_too_large",
    )


def headers_too_large(message: str) -> OpenAIError:
    return OpenAIError(
        431, message, "invalid_request_error", code="request_header_fields_too_large"
    )


def check_headers(headers: list[tuple[bytes, bytes]], limits: HttpLimits) -> OpenAIError | None:
    """The error to answer for ``headers`` (an ASGI scope's), or None when they are within
    ``limits``: the header count and size, then the declared body size."""
    if len(headers) > limits.max_header_count:
        return headers_too_large(
            f"The request has {len(headers)} header fields, more than the limit of "
            f"{limits.max_header_count}"
        )
    num_bytes = sum(len(name) + len(value) for name, value in headers)
    if num_bytes > limits.max_header_bytes:
        return headers_too_large(
            f"The request's header fields take {num_bytes} bytes, more than the limit of "
            f"{limits.max_header_bytes} bytes"
        )
    for name, value in headers:
        if name == b"content-length":
            return _content_length_error(value.decode("latin-1").strip(), limits)
    return None


def _content_length_error(text: str, limits: HttpLimits) -> OpenAIError | None:
    if not (text.isascii() and text.isdigit()):
        return invalid_request(f"Content-Length must be a non-negative integer, got {text!r}")
    if int(text) > limits.max_request_body_bytes:
        return body_too_large(limits.max_request_body_bytes)
    return None


class RequestLimitsMiddleware:
    """Pure ASGI middleware enforcing ``limits`` on every HTTP request (see module doc)."""

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = check_headers(scope["headers"], self.limits)
        if error is not None:
            await answer(error, scope, receive, send)
            return
        body = _CountedBody(self.limits.max_request_body_bytes, scope, receive, send)
        await self.app(scope, body.receive, body.send)


class _CountedBody:
    """One request's ``receive`` and ``send`` as the app sees them: the body counted against
    ``limit``, and at most one response started (the app's, or the 413 this answers)."""

    def __init__(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        self.limit = limit
        self.scope = scope
        self._receive = receive
        self._send = send
        self.num_bytes = 0
        self.exceeded = False
        self.response_started = False
        self.answered = False

    async def receive(self) -> Message:
        if self.exceeded:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.num_bytes += len(message.get("body", b""))
            if self.num_bytes > self.limit:
                self.exceeded = True
                if not self.response_started:
                    self.answered = True
                    await answer(body_too_large(self.limit), self.scope, self._receive, self._send)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)


async def answer(error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Send ``error`` as the response, closing the connection after it."""
    response = error.response()
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` matching ``limits``. They only matter when uvicorn
    falls back to h11 (httptools not installed), whose header buffer defaults to 16 KiB; the
    httptools parser has no such limit or option."""
    header_block = (
        limits.max_header_bytes
        + limits.max_header_count * _H11_BYTES_PER_HEADER
        + _H11_REQUEST_LINE_BYTES
    )
    return {"h11_max_incomplete_event_size": header_block}
