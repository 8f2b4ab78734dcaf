"""Sampling defaults from the model's generation_config.json (``--generation-config``): the file
checked at start-up, hostile ones refused with its path and field; through real HTTP against the
fake scheduler, a field a request leaves out takes the model's default and one it sends is kept,
``vllm`` ignores the file and a directory takes its own."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import httpx
import pytest

from api_server.__main__ import build_config, parse_args
from api_server.generation_config import (
    MAX_GENERATION_CONFIG_BYTES,
    NO_DEFAULTS,
    SamplingParamsGenerationConfigDefaults,
    generation_config_source,
    generation_limit,
    load_generation_defaults,
    with_default_max_new_tokens,
)
from interfaces import SamplingParams, TextContext

MODEL_DEFAULTS = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.05,
    "max_new_tokens": 7,
}
OTHER_DEFAULTS = {"temperature": 0.3, "top_k": 50, "max_new_tokens": 5}  # top_k 50: transformers'
"""A directory given: its max_new_tokens is also a limit on every request, as in vLLM."""
MESSAGES = [{"role": "user", "content": "Hi"}]


def write_config(directory: Path, content: str | dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (directory / "generation_config.json").write_text(text)
    return directory


def test_the_sampling_values_of_the_file_are_the_defaults(tmp_path: Path) -> None:
    content = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, **MODEL_DEFAULTS}
    defaults = load_generation_defaults(write_config(tmp_path, content))
    assert defaults.overrides == MODEL_DEFAULTS
    assert load_generation_defaults(tmp_path, "vllm") == NO_DEFAULTS
    assert load_generation_defaults(tmp_path / "none") == NO_DEFAULTS  # auto, no file: none


def test_transformers_defaults_nulls_and_do_sample_are_no_defaults(tmp_path: Path) -> None:
    same = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
    assert load_generation_defaults(write_config(tmp_path / "a", same)).overrides == {}
    nulls = {"temperature": None, "top_p": None, "max_new_tokens": None}
    assert load_generation_defaults(write_config(tmp_path / "b", nulls)).overrides == {}
    # As in vLLM, do_sample is not read: the file's temperature is the default all the same.
    not_sampled = {"do_sample": False, "temperature": 0.7, "top_p": 0.8, "max_new_tokens": 9}
    assert load_generation_defaults(write_config(tmp_path / "c", not_sampled)).overrides == {
        "temperature": 0.7,
        "top_p": 0.8,
        "max_new_tokens": 9,
    }
    assert load_generation_defaults(write_config(tmp_path / "d", {"do_sample": 0})).overrides == {}


def test_a_directory_given_takes_its_own_file(tmp_path: Path) -> None:
    model, other = write_config(tmp_path / "model", MODEL_DEFAULTS), tmp_path / "other"
    write_config(other, OTHER_DEFAULTS)
    defaults = load_generation_defaults(model, str(other))
    assert defaults.overrides == {"temperature": 0.3, "max_new_tokens": 5}
    assert generation_limit(defaults, str(other)) == 5
    assert generation_limit(load_generation_defaults(model), "auto") is None
    with pytest.raises(ValueError) as raised:
        load_generation_defaults(model, str(tmp_path / "missing"))
    expected = f"--generation-config {tmp_path / 'missing'}: there is no "
    assert str(raised.value) == expected + str(tmp_path / "missing" / "generation_config.json")


def test_the_flag_keeps_its_keywords_and_makes_a_directory_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert (generation_config_source("auto"), generation_config_source("vllm")) == ("auto", "vllm")
    assert generation_config_source("configs/x") == str(tmp_path.resolve() / "configs" / "x")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"temperature": NaN}', "JSON is malformed: invalid character (byte 16)"),
        ('{"temperature": Infinity}', "JSON is malformed: invalid character (byte 16)"),
        ('{"temperature": 1e400}', "Number out of range - at `$.temperature`"),
        ('{"temperature": 5}', "Expected `float` <= 2.0 - at `$.temperature`"),
        ('{"temperature": -0.1}', "Expected `float` >= 0.0 - at `$.temperature`"),
        ('{"temperature": "0.7"}', "Expected `float | null`, got `str` - at `$.temperature`"),
        ('{"temperature": true}', "Expected `float | null`, got `bool` - at `$.temperature`"),
        ('{"top_p": 0}', "Expected `float` > 0.0 - at `$.top_p`"),
        ('{"top_k": 1e3}', "Expected `int | null`, got `float` - at `$.top_k`"),
        ('{"top_k": -2}', "Expected `int` >= -1 - at `$.top_k`"),
        ('{"top_k": 99999999999999999999}', "Expected `int` <= 2147483647 - at `$.top_k`"),
        ('{"min_p": 1.5}', "Expected `float` <= 1.0 - at `$.min_p`"),
        ('{"repetition_penalty": 0}', "Expected `float` >= 0.01 - at `$.repetition_penalty`"),
        ('{"max_new_tokens": 0}', "Expected `int` >= 1 - at `$.max_new_tokens`"),
        ('{"max_new_tokens": {"a": [1]}}', "Expected `int | null`, got `object` - at "),
        ('["temperature", 0.7]', "Expected `object`, got `array`"),
        ("", "Input data was truncated"),
        ('{"junk": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_a_hostile_file_given_is_refused_and_the_models_own_loses_what_fails(
    tmp_path: Path, content: str, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    write_config(tmp_path, content)
    with pytest.raises(ValueError) as raised:
        load_generation_defaults(tmp_path, str(tmp_path))  # --generation-config DIR
    path = tmp_path / "generation_config.json"
    assert str(raised.value).startswith(f"{path} is not a valid generation config: {problem}")
    with caplog.at_level(logging.WARNING, logger="api_server.generation_config"):
        assert load_generation_defaults(tmp_path, log=True) == NO_DEFAULTS  # auto
    [warning] = caplog.records
    assert warning.getMessage().startswith(f"{path} is not a valid generation config: {problem}")


def test_the_models_own_file_keeps_the_fields_that_are_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM serves a model whose file has an odd value, so does ``auto``: without it."""
    write_config(tmp_path, {"top_k": 50.0, "top_p": 0, "temperature": 0.6, "max_new_tokens": 9})
    with caplog.at_level(logging.WARNING, logger="api_server.generation_config"):
        defaults = load_generation_defaults(tmp_path, log=True)
    assert defaults.overrides == {"temperature": 0.6, "max_new_tokens": 9}
    assert (
        caplog.records[0]
        .getMessage()
        .endswith("; ignoring top_p, top_k (an explicit --generation-config DIR refuses it)")
    )


def test_a_huge_file_and_one_that_is_not_utf8_are_refused(tmp_path: Path) -> None:
    padding = "x" * MAX_GENERATION_CONFIG_BYTES
    huge = write_config(tmp_path / "huge", json.dumps({"temperature": 0.5, "junk": padding}))
    with pytest.raises(ValueError) as raised:
        load_generation_defaults(huge, str(huge))
    path = tmp_path / "huge" / "generation_config.json"
    assert str(raised.value) == (
        f"{path} is not a generation config: larger than {MAX_GENERATION_CONFIG_BYTES} bytes"
    )
    assert load_generation_defaults(huge) == NO_DEFAULTS  # auto: the file is left out
    (tmp_path / "generation_config.json").write_bytes(b'{"temperature": "\xff"}')
    with pytest.raises(ValueError, match="is not a valid generation config: "):
        load_generation_defaults(tmp_path, str(tmp_path))


def context(num_prompt_tokens: int, max_length: int, **params) -> TextContext:
    return TextContext("r", [1] * num_prompt_tokens, max_length, [2], SamplingParams(**params))


def test_the_default_max_new_tokens_is_capped_by_the_room_and_min_tokens() -> None:
    defaults = SamplingParamsGenerationConfigDefaults(max_new_tokens=7)
    capped = with_default_max_new_tokens(context(10, 100), defaults)
    assert (capped.max_length, capped.sampling_params.max_new_tokens) == (17, 7)
    room = context(95, 100)  # 5 tokens of room: the context ends it, as without a default
    assert with_default_max_new_tokens(room, defaults) is room
    at_least = with_default_max_new_tokens(context(10, 100, min_new_tokens=9), defaults)
    assert (at_least.max_length, at_least.sampling_params.max_new_tokens) == (19, 9)
    asked = context(10, 13, max_new_tokens=3)  # the request's own maximum
    assert with_default_max_new_tokens(asked, defaults) is asked
    assert with_default_max_new_tokens(context(10, 100), NO_DEFAULTS).max_length == 100


def test_a_limit_caps_what_a_request_asks_and_refuses_min_tokens_above_it() -> None:
    defaults = SamplingParamsGenerationConfigDefaults(max_new_tokens=7)
    asked = context(10, 30, max_new_tokens=20)
    capped = with_default_max_new_tokens(asked, defaults, limit=7)
    assert (capped.max_length, capped.sampling_params.max_new_tokens) == (17, 7)
    below = context(10, 13, max_new_tokens=3)
    assert with_default_max_new_tokens(below, defaults, limit=7) is below
    unset = with_default_max_new_tokens(context(10, 100), NO_DEFAULTS, limit=4)
    assert (unset.max_length, unset.sampling_params.max_new_tokens) == (14, 4)
    room = context(10, 12)  # the context's room (2) is below the limit
    assert with_default_max_new_tokens(room, defaults, limit=7) is room
    at_limit = context(10, 100, min_new_tokens=7)
    assert with_default_max_new_tokens(at_limit, defaults, limit=7).max_length == 17
    with pytest.raises(ValueError, match=r"min_tokens \(8\) is above this server's limit of 7"):
        with_default_max_new_tokens(context(10, 100, min_new_tokens=8), defaults, limit=7)


def test_a_bad_file_given_stops_the_api_server_at_start(
    tmp_path: Path, default_model_dir: Path
) -> None:
    model_dir = linked_model_dir(default_model_dir, tmp_path / "model", {"top_p": 2})
    model = ["--model", str(model_dir), "--scheduler-addr", "ipc://unused"]
    args = parse_args([*model, "--generation-config", str(model_dir)])
    with pytest.raises(ValueError, match=r"generation_config.json is not a valid generation con"):
        build_config(args)
    assert build_config(parse_args(model)).generation_defaults == NO_DEFAULTS  # auto
    args = parse_args(["--scheduler-addr", "ipc://unused", "--generation-config", "vllm"])
    with pytest.raises(ValueError, match="--generation-config describes --model; give it"):
        build_config(args)


def linked_model_dir(model_dir: Path, target: Path, generation_config: dict) -> Path:
    """``model_dir``'s files linked into ``target``, but its own generation_config.json."""
    target.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.name != "generation_config.json":
            (target / file.name).symlink_to(file)
    return write_config(target, {"eos_token_id": 2, **generation_config})


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(the fake scheduler, the API server's app, its URL, a config by ``--generation-config``
    value) for a model whose generation_config.json holds MODEL_DEFAULTS; the app starts with
    ``auto``'s config."""
    from api_server.app import create_app
    from tests.support.fake_scheduler import FakeScheduler, UvicornThread

    work = tmp_path_factory.mktemp("generation-config")
    model_dir = linked_model_dir(default_model_dir, work / "model", MODEL_DEFAULTS)
    other = write_config(work / "other", OTHER_DEFAULTS)
    address = f"ipc://{work}/scheduler.ipc"
    scheduler = FakeScheduler(address).start()
    configs = {}
    for source in ("auto", "vllm", str(other)):
        argv = ["--model", str(model_dir), "--scheduler-addr", address]
        config = build_config(parse_args([*argv, "--generation-config", source]))
        configs[source] = dataclasses.replace(config, api_key=None)
    configs["dir"] = configs.pop(str(other))
    app = create_app(configs["auto"])
    uvicorn = UvicornThread(app).start()
    yield scheduler, app, uvicorn.url, configs
    uvicorn.stop()
    scheduler.stop()


def submit(server, body: dict, source: str = "auto", route: str = "chat") -> TextContext:
    """The context the scheduler got for ``body``, sent to the server configured by ``source``."""
    scheduler, app, url, configs = server
    app.state.server.config = configs[source]
    try:
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        request = {"messages": MESSAGES} if route == "chat" else {"prompt": "Hi"}
        response = httpx.post(url + path, json=request | body, timeout=10)
    finally:
        app.state.server.config = configs["auto"]
    assert response.status_code == 200, response.text
    return scheduler.submitted[-1]


def test_the_config_logs_the_defaults_that_apply(
    default_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = linked_model_dir(default_model_dir, tmp_path / "model", {"temperature": 0.6})
    args = parse_args(["--model", str(model_dir), "--scheduler-addr", "ipc://unused"])
    with caplog.at_level(logging.INFO, logger="api_server.generation_config"):
        assert build_config(args).generation_defaults.overrides == {"temperature": 0.6}
    assert [record.getMessage() for record in caplog.records] == [
        "Default sampling parameters have been overridden by the model's generation config "
        f"{model_dir / 'generation_config.json'}: temperature=0.6 (--generation-config vllm "
        "ignores it)"
    ]


def test_fields_a_request_leaves_out_take_the_models_defaults(server) -> None:
    model_defaults = SamplingParams(
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        temperature=0.6,
        repetition_penalty=1.05,
        max_new_tokens=7,
        seed=5,
    )
    sent = submit(server, {"seed": 5})
    assert sent.sampling_params == model_defaults
    assert sent.max_length == sent.num_prompt_tokens + 7
    nulls = {"temperature": None, "top_p": None, "max_tokens": None, "seed": 5}  # null: not set
    assert submit(server, nulls).sampling_params == model_defaults


def test_fields_a_request_sends_are_kept_even_openais_defaults(server) -> None:
    body = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 3}
    body |= {"repetition_penalty": 1.0, "seed": 5}
    assert submit(server, body).sampling_params == SamplingParams(
        top_k=-1, max_new_tokens=3, seed=5
    )
    partial = submit(server, {"temperature": 0, "max_completion_tokens": 2, "seed": 5})
    assert partial.sampling_params == SamplingParams(
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        temperature=0.0,
        repetition_penalty=1.05,
        max_new_tokens=2,
        seed=5,
    )


def test_completions_keep_16_unless_max_tokens_is_null_as_in_vllm(server) -> None:
    absent = submit(server, {"seed": 5}, route="completions").sampling_params
    assert (absent.max_new_tokens, absent.temperature) == (16, 0.6)
    null = {"max_tokens": None, "seed": 5}
    assert submit(server, null, route="completions").sampling_params.max_new_tokens == 7
    sent = submit(server, {"max_tokens": 9, "seed": 5}, route="completions")
    assert (sent.sampling_params.max_new_tokens, sent.sampling_params.temperature) == (9, 0.6)


def test_vllm_ignores_the_file_and_a_directory_takes_its_own(server) -> None:
    assert submit(server, {"seed": 5}, "vllm").sampling_params == SamplingParams(top_k=-1, seed=5)
    assert submit(server, {"seed": 5}, "dir").sampling_params == SamplingParams(
        top_k=-1, temperature=0.3, max_new_tokens=5, seed=5
    )
    completion = submit(server, {"seed": 5}, "vllm", route="completions")
    assert completion.sampling_params.max_new_tokens == 16


def test_a_directory_given_limits_every_request_as_in_vllm(server) -> None:
    """The model's own file (auto) only gives a default; a directory's max_new_tokens caps
    what a request asks (vLLM's ``--generation-config DIR``), and a min_tokens above it is a
    400 beside an innocent request that still completes."""
    asked = {"max_tokens": 9, "seed": 5}
    assert submit(server, asked, "auto", route="completions").sampling_params.max_new_tokens == 9
    limited = submit(server, asked, "dir", route="completions")
    assert limited.sampling_params.max_new_tokens == 5
    assert limited.max_length == limited.num_prompt_tokens + 5
    chat = submit(server, {"max_completion_tokens": 50, "seed": 5}, "dir")
    assert chat.sampling_params.max_new_tokens == 5
    _, app, url, configs = server
    app.state.server.config = configs["dir"]
    try:
        refused = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": MESSAGES, "min_tokens": 6, "max_tokens": 8},
            timeout=10,
        )
        innocent = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=10)
    finally:
        app.state.server.config = configs["auto"]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "min_tokens")
    assert "min_tokens (6) is above this server's limit of 5 new tokens" in error["message"]
    assert innocent.status_code == 200, innocent.text


def test_serve_checks_the_file_before_starting_anything(tmp_path: Path) -> None:
    from api_server.config import ApiServerSettings
    from switchyard.serve_config import ServeConfig

    model_dir = write_config(tmp_path, {"top_k": "20"})
    given = ApiServerSettings(generation_config=str(model_dir))
    with pytest.raises(ValueError) as raised:
        ServeConfig(model_dir=model_dir, served_model_name="m", api_server=given)
    assert str(raised.value) == (
        f"{model_dir / 'generation_config.json'} is not a valid generation config: "
        "Expected `int | null`, got `str` - at `$.top_k`"
    )
    ignored = ApiServerSettings(generation_config="vllm")
    config = ServeConfig(model_dir=model_dir, served_model_name="m", api_server=ignored)
    assert config.api_server.generation_config == "vllm"  # the file is not read
    with pytest.raises(ValueError, match=r"^--generation-config configure the text generation"):
        ServeConfig(None, None, embedding_model_dir=model_dir, api_server=ignored)
