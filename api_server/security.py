"""API key authentication and CORS for one API server.

With an API key configured, every request must carry ``Authorization: Bearer <key>``, except
``/health`` and ``/ready`` (orchestrators' probes), ``/metrics`` (Prometheus scrapes; vLLM
leaves it open too), and CORS preflight ``OPTIONS`` requests (browsers send them without
credentials). A missing or wrong key is a 401 in OpenAI's error shape. Keys are compared in
constant time. With CORS on, browsers may read the ``X-Request-Id`` response header.

CORS is off unless allowed origins are configured; then Starlette's ``CORSMiddleware`` wraps
everything, so even a 401 carries the CORS headers a browser needs to read it.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from api_server.errors import OpenAIError
from api_server.request_id import HEADER as REQUEST_ID_HEADER

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def missing_api_key() -> OpenAIError:
    return OpenAIError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization "
        "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        "invalid_request_error",
    )


def invalid_api_key() -> OpenAIError:
    return OpenAIError(
        401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key"
    )


class ApiKeyMiddleware:
    """Pure ASGI middleware: answers 401 unless the request carries the key (see module doc)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key_digest = _digest(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._needs_key(scope):
            await self.app(scope, receive, send)
            return
        error = self._check(_authorization(scope))
        if error is None:
            await self.app(scope, receive, send)
            return
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    @staticmethod
    def _needs_key(scope: Scope) -> bool:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return False
        return scope["path"] not in OPEN_PATHS

    def _check(self, authorization: str | None) -> OpenAIError | None:
        """None when ``authorization`` is "Bearer <the key>", else the error to answer."""
        if not authorization:
            return missing_api_key()
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return missing_api_key()
        # Comparing fixed-length digests keeps even the key's length from leaking by timing.
        if not hmac.compare_digest(_digest(token.strip()), self._key_digest):
            return invalid_api_key()
        return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", errors="surrogateescape")).digest()


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


def install_security(app: FastAPI, api_key: str | None, allowed_origins: tuple[str, ...]) -> None:
    """Add the API key check (if ``api_key``) and CORS (if ``allowed_origins``) to ``app``.

    CORS is added last so that it is the outer layer: preflights never reach the key check,
    and 401s get CORS headers.
    """
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[REQUEST_ID_HEADER],
        )
