"""Logging for every Switchyard process: one format flag, and the request id on every line.

``--log-format text`` (the default) writes ``TIME LEVEL ROLE LOGGER [REQUEST ID]: MESSAGE``;
``--log-format json`` writes one JSON object per line (python-json-logger) with ``time``,
``level``, ``role``, ``process`` (the pid: several API servers share a role), ``logger``,
``message``, and ``request_id`` when the line is about one request. The request id comes from
``extra={"request_id": ...}`` or, in the API server, from the HTTP request being served
(``CURRENT_REQUEST_ID``, set by its middleware and inherited by the tasks it starts).
"""

from __future__ import annotations

import contextvars
import logging
import sys
from dataclasses import dataclass

from pythonjsonlogger.json import JsonFormatter

from interfaces import envs
from interfaces.settings import setting

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

CURRENT_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "switchyard_request_id", default=None
)
"""The id of the request the current task works for (None outside one)."""


@dataclass(frozen=True)
class LogSettings:
    """How a process logs: every role's ``--log-level`` and ``--log-format``, defaulting to
    $SWITCHYARD_LOG_LEVEL and $SWITCHYARD_LOG_FORMAT (how the launcher and containers set them
    for every process)."""

    level: str = setting(
        "INFO",
        "--log-level",
        "least severe records logged",
        parse=str.upper,
        choices=LOG_LEVELS,
        env_default=envs.log_level,
        default_text="$SWITCHYARD_LOG_LEVEL or INFO",
    )
    format: str = setting(
        "text",
        "--log-format",
        "text lines or one JSON object per line",
        parse=str.lower,
        choices=LOG_FORMATS,
        env_default=envs.log_format,
        default_text="$SWITCHYARD_LOG_FORMAT or text",
    )


def configure_logging(role: str, level: str = "INFO", log_format: str = "text") -> None:
    """Send every logger's records to stderr in ``log_format``, tagged with ``role``."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {log_format}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                "{asctime}{levelname}{process}{name}{message}",
                style="{",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                static_fields={"role": role},
            )
        )
    else:
        handler.setFormatter(
            TextFormatter(f"%(asctime)s %(levelname)s {role} %(name)s%(request_tag)s: %(message)s")
        )
    logging.basicConfig(level=level, handlers=[handler], force=True)


class RequestIdFilter(logging.Filter):
    """Gives a record the current request's id unless it names one itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            request_id = CURRENT_REQUEST_ID.get()
            if request_id is not None:
                record.request_id = request_id
        return True


class TextFormatter(logging.Formatter):
    """``[request id]`` after the logger's name when the record has one."""

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.request_tag = f" [{request_id}]" if request_id else ""
        return super().format(record)
