"""API key authentication and CORS, and how their flags reach an API server (the key never
in argv)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import httpx
import openai
import pytest

from api_server.__main__ import build_config, parse_args
from api_server.bind_address import is_loopback, listening_host
from api_server.config import ApiServerSettings
from api_server.security import is_json_media_type, is_local_host_header
from switchyard import cli
from switchyard.cli import build_parser
from switchyard.launcher import Launcher, child_environment
from switchyard.serve_config import ServeConfig
from tests.support.fake_scheduler import ApiHarness
from tests.support.serve_process import ServeProcess

KEY = "sk-switchyard-test"
ORIGIN = "https://app.example"
MESSAGES = [{"role": "user", "content": "Hi"}]
MISSING_KEY = {
    "message": "You didn't provide an API key. You need to provide your API key in an "
    "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    "type": "invalid_request_error",
    "param": None,
    "code": None,
}
WRONG_KEY = {
    "message": "Incorrect API key provided.",
    "type": "invalid_request_error",
    "param": None,
    "code": "invalid_api_key",
}


@pytest.fixture(scope="module")
def secured(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An API server with an API key and CORS for ORIGIN."""
    harness = ApiHarness(
        default_model_dir,
        tmp_path_factory.mktemp("api-secured"),
        api_key=KEY,
        allowed_origins=(ORIGIN,),
    )
    harness.scheduler.reply = [19556, 905]
    harness.scheduler.eos_token_id = 2
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def plain(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An API server with neither an API key nor CORS, told it listens on every address."""
    harness = ApiHarness(
        default_model_dir, tmp_path_factory.mktemp("api-plain"), bind_host="0.0.0.0"
    )
    yield harness
    harness.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", {"messages": MESSAGES}),
        ("POST", "/v1/completions", {"prompt": "x"}),
        ("POST", "/v1/responses", {"input": "x"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/adapters/x"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/version", None),
        ("GET", "/openapi.json", None),
        ("GET", "/no/such/route", None),
    ],
)
def test_every_route_needs_the_key(secured: ApiHarness, method: str, path: str, body) -> None:
    with httpx.Client(base_url=secured.url, timeout=10) as client:
        missing = client.request(method, path, json=body)
        assert (missing.status_code, missing.json()) == (401, {"error": MISSING_KEY})
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = client.request(method, path, json=body, headers=bearer(KEY + "x"))
        assert (wrong.status_code, wrong.json()) == (401, {"error": WRONG_KEY})
        not_bearer = client.request(method, path, json=body, headers={"Authorization": KEY})
        assert not_bearer.status_code == 401
        right = client.request(method, path, json=body, headers=bearer(KEY))
        assert right.status_code == (404 if path == "/no/such/route" else 200)


def test_probes_and_metrics_stay_open(secured: ApiHarness) -> None:
    with httpx.Client(base_url=secured.url, timeout=10) as client:
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/ready").json() == {"status": "ready"}
        assert client.get("/metrics").status_code == 200


def test_openai_client_with_and_without_the_key(secured: ApiHarness) -> None:
    url = f"{secured.url}/v1"
    good = openai.OpenAI(base_url=url, api_key=KEY, timeout=10, max_retries=0)
    reply = good.chat.completions.create(model=secured.MODEL_NAME, messages=MESSAGES)
    assert reply.choices[0].message.content == "Hello world"
    bad = openai.OpenAI(base_url=url, api_key="sk-wrong", timeout=10, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        bad.models.list()
    assert raised.value.code == "invalid_api_key"


def test_cors_headers_for_an_allowed_origin(secured: ApiHarness) -> None:
    with httpx.Client(base_url=secured.url, timeout=10) as client:
        response = client.get("/v1/models", headers={"Origin": ORIGIN, **bearer(KEY)})
        assert response.headers["access-control-allow-origin"] == ORIGIN
        assert response.headers["access-control-expose-headers"] == "X-Request-Id"
        refused = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # a browser can read the 401: it has CORS headers too
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        other = client.get("/v1/models", headers={"Origin": "https://evil.example", **bearer(KEY)})
        assert "access-control-allow-origin" not in other.headers


def test_cors_preflight_needs_no_key(secured: ApiHarness) -> None:
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with httpx.Client(base_url=secured.url, timeout=10) as client:
        response = client.options("/v1/chat/completions", headers=headers)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"


def test_no_cors_and_no_key_unless_configured(plain: ApiHarness) -> None:
    with httpx.Client(base_url=plain.url, timeout=10) as client:
        response = client.get("/v1/models", headers={"Origin": ORIGIN})
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers
        preflight = client.options(
            "/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
        )
        assert preflight.status_code == 405
        assert "access-control-allow-origin" not in preflight.headers


def test_api_server_flags(default_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--model", str(default_model_dir), "--scheduler-addr", "ipc://s"]
    monkeypatch.delenv("SWITCHYARD_API_KEY", raising=False)
    config = build_config(parse_args(base))
    assert (config.api_key, config.allowed_origins) == (None, ())
    monkeypatch.setenv("SWITCHYARD_API_KEY", KEY)
    origins = ["--allowed-origins", "https://a.example, https://b.example"]
    config = build_config(parse_args([*base, *origins, "--allowed-origins", "*"]))
    assert config.api_key == KEY
    assert config.allowed_origins == ("https://a.example", "https://b.example", "*")
    assert KEY not in repr(config)
    assert build_config(parse_args([*base, "--api-key", "other"])).api_key == "other"


def test_serve_passes_the_key_by_environment_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWITCHYARD_API_KEY", "from-env")
    args = build_parser().parse_args(
        ["serve", "--allowed-origins", "a,b", "--allowed-origins", "c"]
    )
    assert (args.api_key, args.allowed_origins) == ("from-env", ["a,b", "c"])
    settings = ApiServerSettings(api_key=KEY, allowed_origins=("a", "b", "c"))
    config = ServeConfig(tmp_path, "m", api_server=settings)
    assert KEY not in repr(config)
    launcher = Launcher(config)
    try:
        argv = launcher._api_server_argv("ipc://frontend", 3)
    finally:
        launcher.shutdown()
    assert argv[argv.index("--allowed-origins") + 1] == "a,b,c"
    assert not any(KEY in arg for arg in argv)
    assert child_environment(KEY)["SWITCHYARD_API_KEY"] == KEY
    assert "SWITCHYARD_API_KEY" not in child_environment(None)  # scheduler, worker


@pytest.mark.slow
def test_serve_with_an_api_key_becomes_ready(default_model_dir) -> None:
    """The launcher's readiness wait and orchestrators' probes need no key."""
    serve = ServeProcess("--api-key", KEY)  # raises unless it became ready
    try:
        with httpx.Client(base_url=serve.base_url, timeout=10) as client:
            assert client.get("/ready").json() == {"status": "ready"}
            assert client.get("/v1/models").status_code == 401
            assert client.get("/v1/models", headers=bearer(KEY)).status_code == 200
    finally:
        serve.kill()


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("localhost", True),
        ("LocalHost:8000", True),
        ("localhost.:80", True),
        ("127.0.0.1", True),
        ("127.0.0.1:8000", True),
        ("127.9.9.9:1", True),
        ("[::1]", True),
        ("[::1]:8000", True),
        ("[::ffff:127.0.0.1]:8000", True),
        ("evil.example", False),
        ("evil.example:8000", False),
        ("127.0.0.1.evil.example:8000", False),
        ("localhost.evil.example", False),
        ("10.0.0.1:8000", False),
        ("[::2]:8000", False),
        ("[::1", False),
        ("::1", True),  # not a valid Host header, but it names only this host
        ("", False),
    ],
)
def test_which_host_headers_name_this_host(host: str, local: bool) -> None:
    assert is_local_host_header(host) is local


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("my-host", False),
        ("", False),
    ],
)
def test_which_bind_addresses_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("content_type", "is_json"),
    [
        ("application/json", True),
        ("Application/JSON ; charset=utf-8", True),
        ("text/plain", False),
        ("application/jsonx", False),
        ("application/ld+json", False),
    ],
)
def test_which_content_types_are_json(content_type: str, is_json: bool) -> None:
    assert is_json_media_type(content_type) is is_json


def test_a_server_listening_beyond_loopback_checks_no_host(plain: ApiHarness) -> None:
    """A reverse proxy in front of it may use any name; the Host check is for loopback binds
    (tests/e2e/test_hostile_http.py has them, on a real server)."""
    with httpx.Client(base_url=plain.url, timeout=10) as client:
        assert client.get("/v1/models", headers={"Host": "api.example:443"}).status_code == 200


def test_the_listening_address_of_an_inherited_socket() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert listening_host("0.0.0.0", listener.fileno()) == "127.0.0.1"
        assert listener.getsockname()[0] == "127.0.0.1"  # left open
    assert listening_host("10.1.2.3", None) == "10.1.2.3"


class LauncherStarted(Exception):
    """Raised by the stand-in Launcher: serve got as far as starting its processes."""


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--host", "0.0.0.0"], True),
        (["--host", "0.0.0.0", "--api-key", KEY], False),
        (["--host", "::1"], False),
        ([], False),
    ],
)
def test_serve_warns_once_when_it_listens_beyond_loopback_without_a_key(
    flags: list[str],
    warned: bool,
    default_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("SWITCHYARD_API_KEY", raising=False)
    monkeypatch.setattr(cli, "setproctitle", lambda title: None)
    monkeypatch.setattr(cli, "_prepare_in_child", lambda model, args: default_model_dir)

    def launcher(config: ServeConfig) -> None:
        raise LauncherStarted(config.bind.host)

    monkeypatch.setattr(cli, "Launcher", launcher)
    args = build_parser().parse_args(["serve", *flags])
    with caplog.at_level(logging.WARNING), pytest.raises(LauncherStarted):
        cli.serve(args)
    warnings = [r.getMessage() for r in caplog.records if r.name == "api_server.bind_address"]
    expected = (
        "listening on 0.0.0.0 without an API key: anyone who can reach this address can use "
        "the model. Set SWITCHYARD_API_KEY (clients then send 'Authorization: Bearer KEY'), or "
        "listen on 127.0.0.1 behind a proxy that authenticates"
    )
    assert warnings == ([expected] if warned else [])
