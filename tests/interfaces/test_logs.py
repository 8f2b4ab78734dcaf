"""Log lines in both formats carry the role and, when there is one, the request id."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LOG_SOME_LINES = """
import logging, sys
from interfaces.logs import CURRENT_REQUEST_ID, configure_logging
configure_logging("api-server", "INFO", sys.argv[1])
log = logging.getLogger("api_server.test")
log.info("outside any request")
token = CURRENT_REQUEST_ID.set("trace-7")
log.info("inside %s", "one")
CURRENT_REQUEST_ID.reset(token)
log.warning("named", extra={"request_id": "chatcmpl-9"})
log.debug("below the level")
"""


def log_lines(log_format: str) -> list[str]:
    completed = subprocess.run(
        [sys.executable, "-c", LOG_SOME_LINES, log_format],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return completed.stderr.splitlines()


def test_json_lines():
    records = [json.loads(line) for line in log_lines("json")]
    assert [record["message"] for record in records] == [
        "outside any request",
        "inside one",
        "named",
    ]
    assert [record.get("request_id") for record in records] == [None, "trace-7", "chatcmpl-9"]
    for record in records:
        assert record["role"] == "api-server"
        assert isinstance(record["process"], int)
        assert record["logger"] == "api_server.test"
        assert record["level"] in ("INFO", "WARNING")
        assert record["time"]


def test_text_lines():
    lines = log_lines("text")
    assert len(lines) == 3
    assert lines[0].endswith(" INFO api-server api_server.test: outside any request")
    assert lines[1].endswith(" INFO api-server api_server.test [trace-7]: inside one")
    assert lines[2].endswith(" WARNING api-server api_server.test [chatcmpl-9]: named")


def test_an_unknown_format_is_refused():
    from interfaces.logs import configure_logging

    with pytest.raises(ValueError, match="--log-format must be one of text, json"):
        configure_logging("x", "INFO", "xml")
