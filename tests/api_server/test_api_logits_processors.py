"""The ``logits_processors`` request field: names (and args) of the user logits processors the
server loads reach the scheduler; other names, and oversized args, are a 400."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from interfaces.sampling import LogitsProcessorCall
from tests.support.fake_scheduler import ApiHarness

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def api(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    harness = ApiHarness(
        default_model_dir,
        tmp_path_factory.mktemp("api"),
        logits_processor_names=("ban_token", "ForceToken"),
    )
    yield harness
    harness.close()


def test_named_processors_and_their_args_reach_the_scheduler(api, client: httpx.Client):
    request = {
        "messages": MESSAGES,
        "max_tokens": 2,
        "logits_processors": ["ForceToken", {"name": "ban_token", "args": {"token": 77}}],
    }
    assert client.post(CHAT, json=request).status_code == 200
    assert api.scheduler.submitted[-1].sampling_params.logits_processors == [
        LogitsProcessorCall("ForceToken"),
        LogitsProcessorCall("ban_token", {"token": 77}),
    ]
    completion = {"prompt": "x", "max_tokens": 2, "logits_processors": ["ban_token"]}
    assert client.post("/v1/completions", json=completion).status_code == 200
    params = api.scheduler.submitted[-1].sampling_params
    assert params.logits_processors == [LogitsProcessorCall("ban_token")]


@pytest.mark.parametrize(
    ("processors", "message"),
    [
        (
            ["ban_token", "nope", {"name": "other"}],
            "logits_processors names processors this server does not load: ['nope', 'other']; "
            "it loads ForceToken, ban_token",
        ),
        (["ban_token", "ban_token"], "logits_processors names a processor more than once"),
        (
            [{"name": "ban_token", "args": {"text": "x" * 5000}}],
            "logits_processors args of 'ban_token' exceed 4096 bytes as JSON",
        ),
    ],
)
def test_unknown_names_and_bad_uses_are_a_400(client: httpx.Client, processors, message):
    response = client.post(CHAT, json={"messages": MESSAGES, "logits_processors": processors})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": "logits_processors",
        "code": None,
    }


def test_too_many_processors_are_a_400(client: httpx.Client):
    """Nine uses, every name distinct and loaded: only the count is wrong."""
    uses = ["ban_token", "ForceToken"] + [{"name": f"p{i}"} for i in range(7)]
    response = client.post(CHAT, json={"messages": MESSAGES, "logits_processors": uses})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "logits_processors"
    assert "at most 8" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "args",
    [
        {"n": 2**70},  # JSON takes it, the wire (msgpack, 64-bit integers) cannot
        {"n": -(2**64)},
        {"deep": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]},  # 17 levels
    ],
)
def test_args_the_wire_cannot_carry_are_a_400(client: httpx.Client, args):
    use = [{"name": "ban_token", "args": args}]
    response = client.post(CHAT, json={"messages": MESSAGES, "logits_processors": use})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "logits_processors args of 'ban_token' must be a JSON object (string keys, integers "
        "of 64 bits, nested at most 16 deep)"
    )
