"""Every HTTP request gets an id: the client's ``X-Request-Id`` or a new one, echoed back in the
response's ``X-Request-Id`` header, set as the logging context (``interfaces.logs``), and used in
the completion's id (``chatcmpl-<id>``, ``cmpl-<id>``), as vLLM does. The scheduler's request ids
add a random suffix to that (``engine_request_id``), so they stay unique when clients reuse an
id, as retrying proxies do, and name the request in the scheduler's logs too. A malformed header
is refused with 400.
"""

from __future__ import annotations

import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_server.errors import invalid_request
from interfaces.logs import CURRENT_REQUEST_ID

HEADER = "X-Request-Id"
VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def current_request_id() -> str:
    """The id of the HTTP request being served (a new one outside of any)."""
    return CURRENT_REQUEST_ID.get() or uuid.uuid4().hex


def engine_request_id(response_id: str) -> str:
    """The scheduler's id for the response ``response_id``: unique however often the client
    reuses its ``X-Request-Id``."""
    return f"{response_id}-{uuid.uuid4().hex[:12]}"


class RequestIdMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so the id reaches streaming responses' tasks."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER)
        if given is not None and not VALID_REQUEST_ID.fullmatch(given):
            error = invalid_request(
                f"{HEADER} must be 1 to 128 letters, digits, '.', '_', ':' or '-'",
                param=HEADER,
            )
            await error.response()(scope, receive, send)
            return
        request_id = given or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(HEADER, request_id)
            await send(message)

        token = CURRENT_REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT_REQUEST_ID.reset(token)
