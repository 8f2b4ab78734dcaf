"""API key authentication and CORS for one API server.

With an API key configured, every request must carry ``Authorization: Bearer <key>``, except
``/health`` and ``/ready`` (orchestrators' probes), ``/metrics`` (Prometheus scrapes; vLLM
leaves it open too), and CORS preflight ``OPTIONS`` requests (browsers send them without
credentials). A missing or wrong key is a 401 in OpenAI's error shape. Keys are compared in
constant time. With CORS on, browsers may read the ``X-Request-Id`` response header.

CORS is off unless allowed origins are configured; then Starlette's ``CORSMiddleware`` wraps
everything, so even a 401 carries the CORS headers a browser needs to read it.

Against web pages driving a key-less local server from the user's browser:

- A body sent with POST, PUT or PATCH must be ``Content-Type: application/json`` (parameters
  such as ``charset`` allowed), as vLLM requires; anything else, a missing type included, is a
  415. A page may send text/plain, form data or an untyped body cross-origin without a CORS
  preflight, but not JSON.
- On a server that listens on a loopback address, the ``Host`` header must name localhost or a
  loopback address (any port), else 400: a page whose own domain an attacker re-pointed at
  127.0.0.1 (DNS rebinding) sends its domain there. A server on any other address checks no
  ``Host`` (a reverse proxy may use any name), and
  ``api_server.bind_address.warn_if_exposed`` logs a warning at start when it has no API key
  either.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from api_server.bind_address import is_loopback
from api_server.errors import OpenAIError, invalid_host, unsupported_media_type
from api_server.request_id import HEADER as REQUEST_ID_HEADER

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
JSON_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_MEDIA_TYPE = "application/json"


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
        error = self._check(_header(scope, b"authorization"))
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


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) in ``scope``, or None."""
    for header, value in scope["headers"]:
        if header == name:
            return value.decode("latin-1")
    return None


class JsonContentTypeMiddleware:
    """Pure ASGI middleware: answers 415 to a POST, PUT or PATCH whose ``Content-Type`` is not
    JSON (see module doc), before its body is read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in JSON_BODY_METHODS:
            content_type = _header(scope, b"content-type")
            if content_type is None or not is_json_media_type(content_type):
                await unsupported_media_type(content_type).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_json_media_type(content_type: str) -> bool:
    """Whether a ``Content-Type`` value is application/json, with or without parameters."""
    return content_type.partition(";")[0].strip().lower() == JSON_MEDIA_TYPE


class LoopbackHostMiddleware:
    """Pure ASGI middleware for a server listening on the loopback address ``bind_host``:
    answers 400 unless the ``Host`` header names localhost or a loopback address."""

    def __init__(self, app: ASGIApp, bind_host: str) -> None:
        self.app = app
        self.bind_host = bind_host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = _header(scope, b"host")
            if host is None or not is_local_host_header(host):
                await invalid_host(self.bind_host).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_local_host_header(host: str) -> bool:
    """Whether a ``Host`` value (``name``, ``name:port``, ``[v6]`` or ``[v6]:port``) names
    localhost or a loopback address."""
    if host.startswith("["):
        name = host[1 : host.find("]")] if "]" in host else ""
    else:
        name = host.rpartition(":")[0] if host.count(":") == 1 else host
    return is_loopback(name)


def install_security(
    app: FastAPI,
    api_key: str | None,
    allowed_origins: tuple[str, ...],
    bind_host: str | None = None,
) -> None:
    """Add the API key check (if ``api_key``), CORS (if ``allowed_origins``) and the ``Host``
    check (if ``bind_host``, the address the server listens on, is a loopback address; None:
    unknown, no check) to ``app``.

    CORS is added after the key check so that it is the outer layer: preflights never reach the
    key check, and 401s get CORS headers. The ``Host`` check is outermost: a rebinding page
    learns nothing, not even whether it needs a key.
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
    if bind_host is not None and is_loopback(bind_host):
        app.add_middleware(LoopbackHostMiddleware, bind_host=bind_host)
