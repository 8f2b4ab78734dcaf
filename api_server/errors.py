"""Every error the API server answers, in OpenAI's shape:
``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.

Handlers installed by ``install_error_handlers`` map malformed JSON and validation errors to 400,
unknown routes to 404, ``OpenAIError`` to its own status, and anything unexpected to a 500 whose
body names no internals (the traceback goes to the log only).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
MAX_ERRORS_DESCRIBED = 8
"""A 400 for a body pydantic rejected describes this many of its errors, then counts the rest."""
TOO_MANY_UNKNOWN_FIELDS = "too_many_unknown_fields"
"""The validation error of an object with more unknown fields than
``api_server.protocol.MAX_UNKNOWN_FIELDS_NAMED``: its ``ctx`` holds the first ``names`` and the
``count``."""


class OpenAIError(Exception):
    """An error answered as ``status_code`` with OpenAI's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object. Text quoted from the request (a field name, a model name) may hold
    a lone surrogate, which UTF-8 cannot encode; it is shown escaped (``\\ud800``)."""
    return {
        "error": {
            "message": _encodable(message),
            "type": error_type,
            "param": None if param is None else _encodable(param),
            "code": code,
        }
    }


def _encodable(text: str) -> str:
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400: the request is wrong and the client can fix it."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> OpenAIError:
    """404 for a model name this server does not serve."""
    return OpenAIError(
        404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found"
    )


def no_generation_model(model: str | None, is_embedding_model: bool) -> OpenAIError:
    """404 for a text generation route on a server that serves only embeddings."""
    if is_embedding_model:
        named = f"`{model}` is an embedding model: only POST /v1/embeddings serves it. "
    else:
        named = "" if model is None else f"The model `{model}` does not exist. "
    message = f"{named}This server serves only embeddings (GET /v1/models lists them)."
    return OpenAIError(404, message, "NotFoundError", "model", "model_not_found")


def unsupported_media_type(content_type: str | None) -> OpenAIError:
    """415 for a body that is not sent as JSON (a web page can POST text/plain cross-origin
    without a CORS preflight; it cannot POST application/json)."""
    sent = "no Content-Type" if content_type is None else f"Content-Type {content_type[:100]!r}"
    return OpenAIError(
        415,
        f"The request has {sent}; send the body as JSON with 'Content-Type: application/json'",
        "invalid_request_error",
        code="unsupported_media_type",
    )


def invalid_host(bind_host: str) -> OpenAIError:
    """400 for a ``Host`` header that names neither localhost nor a loopback address, on a
    server that listens on a loopback address (what a DNS rebinding page would send)."""
    return OpenAIError(
        400,
        f"Invalid Host header: this server listens on the loopback address {bind_host} and "
        "serves only requests for localhost, 127.0.0.1 or [::1] (any port), so that no web "
        "page can reach it by DNS rebinding",
        "invalid_request_error",
        code="invalid_host",
    )


RETRY_AFTER_S = 1
"""What a 429 or 503 tells the client to wait before retrying (``Retry-After``, seconds)."""


def service_unavailable(message: str) -> OpenAIError:
    """503: the scheduler cannot be reached, is not ready, or this server is shutting down."""
    return OpenAIError(
        503,
        message,
        "service_unavailable_error",
        code="service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def overloaded(message: str) -> OpenAIError:
    """429: the scheduler's queue is full; the same request may succeed after Retry-After."""
    return OpenAIError(
        429,
        message,
        "rate_limit_error",
        code="server_overloaded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def server_error(message: str) -> OpenAIError:
    """500: the system failed the request (a worker died, the KV cache cannot hold it, ...)."""
    return OpenAIError(500, message, "server_error", code="internal_error")


def validation_error(error: RequestValidationError) -> OpenAIError:
    """400 for a body pydantic rejected: malformed JSON, missing, mistyped or unknown fields."""
    details = list(error.errors())
    unknown, count = unknown_fields(details)
    if unknown:
        names = ", ".join(_field_path(loc) for loc in unknown)
        more = f" ({count} in all)" if count > len(unknown) else ""
        return invalid_request(f"Unrecognized request argument supplied: {names}{more}")
    for detail in details:
        if detail["type"] == "json_invalid":
            reason = detail.get("ctx", {}).get("error", detail.get("msg"))
            where = detail["loc"][-1] if len(detail["loc"]) > 1 else "?"
            return invalid_request(
                f"The request body is not valid JSON: {reason} at character {where}"
            )
        if detail["type"] == "string_unicode":
            param = _field_path(detail["loc"]) or None
            return invalid_request(
                f"{param or 'A field name'} is not valid Unicode: it holds a lone surrogate",
                param=param,
            )
        if tuple(detail["loc"]) == ("body",) and detail["type"] != "missing":
            return invalid_request(
                "The request body must be a JSON object sent as Content-Type: application/json"
            )
    messages = list(dict.fromkeys(_describe(detail) for detail in details))
    more = len(messages) - MAX_ERRORS_DESCRIBED
    if more > 0:
        messages = [*messages[:MAX_ERRORS_DESCRIBED], f"and {more} more"]
    param = _field_path(details[0]["loc"]) if details else None
    return invalid_request("; ".join(messages), param=param or None)


def unknown_fields(details: list[Any]) -> tuple[list[tuple[Any, ...]], int]:
    """The locations of the unknown fields that validation ``details`` name, and how many
    there were in all: each ``extra_forbidden`` error names one; an object with too many
    (``api_server.protocol.OpenAIBaseModel``) names its first few and counts them all."""
    locations: list[tuple[Any, ...]] = []
    count = 0
    for detail in details:
        if detail["type"] == "extra_forbidden":
            locations.append(tuple(detail["loc"]))
            count += 1
        elif detail["type"] == TOO_MANY_UNKNOWN_FIELDS:
            locations += [(*detail["loc"], name) for name in detail["ctx"]["names"]]
            count += detail["ctx"]["count"]
    return locations, count


def _describe(detail: dict[str, Any]) -> str:
    path = _field_path(detail["loc"])
    if detail["type"] == "missing":
        return f"'{path}' is a required property" if path else "A JSON request body is required"
    message = detail.get("msg", "invalid value")
    return f"{path}: {message}" if path else message


def _field_path(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "content")`` → ``messages[0].content`` (union tags dropped)."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in str(part) or str(part) in _UNION_TAGS:
            continue
        else:
            path += f".{part}" if path else str(part)
    return path


async def _openai_error_handler(_: Request, error: OpenAIError) -> JSONResponse:
    return error.response()


async def _validation_handler(_: Request, error: RequestValidationError) -> JSONResponse:
    return validation_error(error).response()


async def _http_error_handler(_: Request, error: StarletteHTTPException) -> JSONResponse:
    error_type = "NotFoundError" if error.status_code == 404 else "invalid_request_error"
    body = error_body(str(error.detail), error_type, code=str(error.status_code))
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


async def _unexpected_error_handler(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s %s", request.method, request.url.path)
    return server_error("Internal server error; see the API server's log.").response()


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through OpenAI's error shape."""
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
