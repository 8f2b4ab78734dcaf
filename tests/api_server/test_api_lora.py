"""LoRA adapters at the API server: vLLM's load and unload routes (each status of the scheduler's
answer as its HTTP error), /v1/models listing adapters with their parent, a request naming an
adapter as its model, and names that are no model a 404 beside an innocent stream."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import httpx
import pytest

from interfaces.lora import LoRAAdapterInfo, LoRAOperation, LoRARequest, LoRAResponse, LoRAStatus
from tests.support.fake_scheduler import ApiHarness

CHAT = "/v1/chat/completions"
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


@pytest.fixture(autouse=True)
def fresh_scheduler(api):
    api.scheduler.max_loras = 4
    yield
    api.scheduler.reset()


def test_load_use_list_and_unload_an_adapter(api, client: httpx.Client):
    response = client.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
    assert response.status_code == 200 and response.text == "done: sql"
    assert api.scheduler.lora_requests[-1] == LoRARequest(
        LoRAOperation.LOAD, "sql", "/adapters/sql"
    )
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [
        (ApiHarness.MODEL_NAME, ApiHarness.MODEL_NAME, None),
        ("sql", "/adapters/sql", ApiHarness.MODEL_NAME),
    ]
    chat = {"model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answer = client.post(CHAT, json=chat)
    assert answer.status_code == 200 and answer.json()["model"] == "sql"
    assert api.scheduler.submitted[-1].lora_name == "sql"
    completion = client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
    assert completion.json()["model"] == "sql"
    assert api.scheduler.submitted[-1].lora_name == "sql"
    client.post(CHAT, json={**chat, "model": ApiHarness.MODEL_NAME})
    assert api.scheduler.submitted[-1].lora_name is None
    assert client.post("/tokenize", json={"model": "sql", "prompt": "x"}).status_code == 200

    assert client.post(UNLOAD, json={"lora_name": "sql"}).status_code == 200
    gone = client.post(CHAT, json=chat)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_an_adapter_loaded_through_another_api_server_is_found(api, client: httpx.Client):
    api.scheduler.lora_adapters = [LoRAAdapterInfo("elsewhere", "/adapters/e")]
    chat = {"model": "elsewhere", "messages": [{"role": "user", "content": "Hi"}]}
    assert client.post(CHAT, json=chat).status_code == 200
    assert api.scheduler.submitted[-1].lora_name == "elsewhere"


@pytest.mark.parametrize(
    ("status", "http_status", "code"),
    [
        (LoRAStatus.LOAD_NAME_EXISTS, 400, "load_name_exists"),
        (LoRAStatus.LOAD_INVALID_PATH, 400, "load_invalid_path"),
        (LoRAStatus.LOAD_INVALID_ADAPTER, 400, "load_invalid_adapter"),
        (LoRAStatus.LOAD_ERROR, 400, "load_error"),
        (LoRAStatus.UNSPECIFIED_ERROR, 503, "service_unavailable"),
    ],
)
def test_a_refused_load_is_an_error_naming_the_problem(api, client, status, http_status, code):
    api.scheduler.lora_answer = LoRAResponse(status, "rank 64 is above --max-lora-rank (16)")
    response = client.post(LOAD, json={"lora_name": "big", "lora_path": "/adapters/big"})
    assert response.status_code == http_status
    error = response.json()["error"]
    assert error["message"] == "rank 64 is above --max-lora-rank (16)" and error["code"] == code


def test_runtime_updates_are_off_unless_the_server_allows_them(api, client: httpx.Client):
    state = api.app.state.server
    allowed = state.config
    state.config = dataclasses.replace(allowed, allow_runtime_lora_updating=False)
    try:
        for path, body in (
            (LOAD, {"lora_name": "x", "lora_path": "/p"}),
            (UNLOAD, {"lora_name": "x"}),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 403
            assert "--allow-runtime-lora-updating" in response.json()["error"]["message"]
    finally:
        state.config = allowed
    assert api.scheduler.lora_requests == []


def test_unloading_an_unknown_adapter_is_a_404(api, client: httpx.Client):
    api.scheduler.lora_answer = LoRAResponse(
        LoRAStatus.UNLOAD_NAME_NONEXISTENT, "The LoRA adapter 'x' cannot be found."
    )
    response = client.post(UNLOAD, json={"lora_name": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "a b", "lora_path": "/p"}, "lora_name"),
        ({"lora_name": ApiHarness.MODEL_NAME, "lora_path": "/p"}, "lora_name"),
        ({"lora_name": "x" * 129, "lora_path": "/p"}, "lora_name"),
        ({"lora_name": "ok", "lora_path": ""}, "lora_path"),
        ({"lora_name": "ok", "lora_path": "/p", "load_inplace": True}, "load_inplace"),
    ],
)
def test_bad_load_requests_are_400s_that_never_reach_the_scheduler(api, client, body, param):
    response = client.post(LOAD, json=body)
    assert response.status_code == 400
    assert param in (response.json()["error"]["param"] or "") + response.json()["error"]["message"]
    assert api.scheduler.lora_requests == []


def test_unknown_models_are_404s_beside_an_innocent_stream(api, client: httpx.Client):
    api.scheduler.reply = list(range(100, 140))
    innocent = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(client.post, CHAT, json=innocent)
        for model in ("nope", "x" * 10_000, "../../etc/passwd", ""):
            chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
            response = client.post(CHAT, json=chat)
            assert response.status_code == 404, model[:20]
            assert response.json()["error"]["code"] == "model_not_found"
        streamed = stream.result(timeout=10)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert '"completion_tokens":40' in streamed.text
