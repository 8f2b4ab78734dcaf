"""One declaration per setting (``interfaces.settings``): each role's flags come from its
settings, each flag declared once, ``switchyard serve`` passes the roles' own flags on (the drift
test), every ``--help`` shows every default, and settings survive the trip to argv and back."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from api_server.__main__ import build_parser as api_server_parser
from api_server.config import (
    ApiServerSettings,
    EmbeddingModelSettings,
    HttpBind,
    HttpLimits,
    MediaConfig,
    RequestLimits,
)
from api_server.response_store import ResponseStoreConfig
from interfaces.logs import LogSettings
from interfaces.settings import add_flags, declarations, from_args, to_argv
from interfaces.shared_settings import (
    LogitsProcessorSettings,
    LoRASettings,
    ModelSettings,
    SchedulerAddress,
)
from interfaces.transport import TransportSecurity, add_transport_flags
from interfaces.worker_to_scheduler import WorkerRole
from scheduler.__main__ import build_parser as scheduler_parser
from scheduler.config import PlacementPolicy, SchedulerConfig, SchedulerSettings, WorkerLimits
from switchyard import cli
from switchyard.launcher import Launcher
from switchyard.serve_config import (
    SERVE_API_SERVER_SETTINGS,
    SERVE_WORKER_SETTINGS,
    ServeConfig,
)
from worker.grammar_limits import GrammarLimits
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
SERVE_KEEPS = {
    "--host": "serve listens itself and hands each API server the socket (--fd)",
    "--port": "likewise",
    "--api-key": "goes to the API servers by environment, never in argv",
    "--log-level": "goes to every child by environment",
    "--log-format": "likewise",
}
"""The flags ``serve`` shares with a role but does not pass on as flags."""
SAMPLE_LEAVES = {
    "--data-parallel-size": "the sample disaggregates (--prefill-workers), which several "
    "hybrid groups exclude; tests/switchyard/test_data_parallel.py gives it",
}
"""The flags ``serve_argv`` leaves at their default, and why."""

SPECULATIVE = '{"num_speculative_tokens": 3}'
"""A non-default --speculative-config for the samples."""
SAMPLE_SCHEDULING = SchedulerConfig(
    *(7, 99, False, 5, 500, 2.5, 1, 9, 8, PlacementPolicy.LEAST_LOADED, SPECULATIVE),
    ("sql=/adapters/sql",),
)
"""The scheduling settings ``serve_argv`` gives, as the scheduler takes them."""


def worker_parser() -> argparse.ArgumentParser:
    from worker.__main__ import build_parser  # torch: only in the tests that need it

    return build_parser()


def serve_parser() -> argparse.ArgumentParser:
    commands = next(
        action
        for action in cli.build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    return commands.choices["serve"]


ROLE_PARSERS = {
    "scheduler": scheduler_parser,
    "worker": worker_parser,
    "api_server": api_server_parser,
}
ROLE_SETTINGS = {
    "scheduler": (SchedulerSettings, TransportSecurity, LogSettings),
    "worker": (WorkerSettings, TransportSecurity, LogSettings),
    "api_server": (ApiServerSettings, TransportSecurity, LogSettings),
    "serve": (ModelSettings, EmbeddingModelSettings, ServeConfig),
}
"""The settings classes whose flags each parser takes (all of them, or some)."""


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag of ``parser`` but --help, by name."""
    return {
        a.option_strings[-1]: a for a in parser._actions if a.option_strings and a.dest != "help"
    }


def serve_argv(tmp_path: Path) -> list[str]:
    """``switchyard serve`` flags, every one with a value other than its default but
    ``SAMPLE_LEAVES``."""
    embedding = tmp_path / "minilm"
    embedding.mkdir()
    (embedding / "config.json").write_text("{}")
    return [
        *("--model", "chat.gguf", "--served-model-name", "chat"),
        *("--embedding-model", str(embedding), "--embedding-model-name", "vectors"),
        *("--host", "127.0.0.2", "--port", "8001", "--api-servers", "2"),
        *("--prefill-workers", "1", "--decode-workers", "2"),
        *("--max-num-seqs", "7", "--max-num-batched-tokens", "99", "--no-prefix-caching"),
        *("--max-queued-requests", "5", "--max-queued-tokens", "500", "--migration-limit", "1"),
        *("--restart-limit", "2", "--worker-return-timeout", "9", "--stall-timeout", "8"),
        *("--kv-transfer-timeout", "2.5", "--placement", "least-loaded"),
        *("--speculative-config", SPECULATIVE),
        *("--device", "cpu", "--kv-cache-memory", "64MiB"),
        *("--dtype", "float16", "--block-size", "32", "--max-model-len", "100"),
        *("--attention-backend", "gathered", "--max-cudagraph-capture-size", "16"),
        *("--float32-matmul-precision", "high"),
        *("--tensor-parallel-size", "2", "--grammar-compile-timeout", "3.5"),
        *("--grammar-mask-timeout", "0.25", "--grammar-mask-time-per-token", "0.03"),
        *("--max-grammar-bytes", "1000", "--max-grammar-alternatives", "10"),
        *("--grammar-cache-bytes", "4096", "--api-key", "secret", "--allowed-origins", "a,b"),
        *("--shutdown-timeout", "4.5", "--max-request-body-bytes", "1000"),
        *("--max-header-count", "10", "--max-header-bytes", "2000", "--max-prompt-bytes", "300"),
        *("--max-structured-output-bytes", "400", "--max-choices-per-request", "5"),
        *("--max-request-output-tokens", "600", "--max-stream-backlog", "7"),
        *("--scheduler-return-timeout", "6"),
        *("--allowed-local-media-path", str(tmp_path), "--allowed-media-domains", "x.com"),
        *("--max-images-per-prompt", "2", "--log-level", "DEBUG", "--log-format", "json"),
        *("--generation-config", "vllm", "--reasoning-parser", "qwen3"),
        *("--logits-processors", "pkg.bans:Ban,pkg.force:Force"),
        *("--lora-modules", "sql=/adapters/sql", "--max-loras", "3", "--max-lora-rank", "8"),
        *("--enable-lora", "--allow-runtime-lora-updating"),
        *("--responses-store-dir", str(tmp_path / "responses"), "--responses-store-max-mb", "5"),
        *("--responses-store-max-age-days", "2"),
    ]


class LauncherStarted(Exception):
    pass


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(serve's parsed flags, the ServeConfig ``switchyard serve`` makes of them, each child's
    command line by name)."""
    monkeypatch.delenv("SWITCHYARD_API_KEY", raising=False)
    monkeypatch.setattr(cli, "setproctitle", lambda title: None)
    monkeypatch.setattr(cli, "_prepare_in_child", lambda model, args: tmp_path)

    def launcher(config) -> None:
        raise LauncherStarted(config)

    monkeypatch.setattr(cli, "Launcher", launcher)
    args = serve_parser().parse_args(serve_argv(tmp_path))
    with pytest.raises(LauncherStarted) as started:
        cli.serve(args)
    config = started.value.args[0]
    launcher = Launcher(config)
    try:
        commands = launcher.engine_argv("ipc://backend")
        commands["api-server"] = launcher._api_server_argv("ipc://frontend", 3)
    finally:
        launcher.shutdown()
    return args, config, commands


def test_the_sample_gives_every_serve_flag_a_value_other_than_its_default(tmp_path, monkeypatch):
    monkeypatch.delenv("SWITCHYARD_API_KEY", raising=False)
    args = serve_parser().parse_args(serve_argv(tmp_path))
    defaults = [
        name for name, a in options(serve_parser()).items() if getattr(args, a.dest) == a.default
    ]
    assert defaults == list(SAMPLE_LEAVES)


def test_each_flag_is_declared_once() -> None:
    """Every flag of each role's parser and of ``serve``'s is declared by a settings class the
    parser takes, and no flag name by two classes: what several roles take is a component they
    share (``ModelSettings``, ``SchedulerAddress``, ``HttpBind``, ...)."""
    owners: dict[str, set[type]] = {}
    for role, roots in ROLE_SETTINGS.items():
        found = set().union(*(declarations(root) for root in roots))
        parser = serve_parser() if role == "serve" else ROLE_PARSERS[role]()
        assert set(options(parser)) <= {name for _, name in found}, role
        for owner, name in found:
            owners.setdefault(name, set()).add(owner)
    assert {name: classes for name, classes in owners.items() if len(classes) > 1} == {}
    assert owners["--scheduler-addr"] == {SchedulerAddress}
    assert owners["--max-model-len"] == {ModelSettings}


def test_every_flag_serve_passes_on_is_the_roles_own_with_its_default_and_choices(served):
    """The drift test: the flags ``switchyard serve`` hands each child, compared with the
    child's parser. A flag serve has and passes on must take the same default and choices in
    the role; every flag serve shares with a role is passed on (or kept, ``SERVE_KEEPS``)."""
    _, _, commands = served
    serve = options(serve_parser())
    roles = {role: options(make()) for role, make in ROLE_PARSERS.items()}
    passed = set()
    for name, argv in commands.items():
        role = roles[argv[0]]
        ROLE_PARSERS[argv[0]]().parse_args(argv[1:])  # the child takes its whole command line
        for flag in (arg for arg in argv[1:] if arg in serve):
            got = (role[flag].default, role[flag].choices, role[flag].type)
            assert got == (serve[flag].default, serve[flag].choices, serve[flag].type), (name, flag)
            passed.add(flag)
    shared = {flag for flag in serve if any(flag in role for role in roles.values())}
    assert passed == shared - set(SERVE_KEEPS)


def test_the_values_given_to_serve_reach_the_roles(served):
    args, config, commands = served
    scheduler = scheduler_parser().parse_args(commands["scheduler"][1:])
    assert from_args(SchedulerSettings, scheduler).scheduling == config.scheduler
    assert config.scheduler == SAMPLE_SCHEDULING
    assert from_args(WorkerSettings, args, SERVE_WORKER_SETTINGS) == config.worker
    for name in ("prefill-0-0", "prefill-0-1", "decode-1-1"):
        worker = from_args(WorkerSettings, worker_parser().parse_args(commands[name][1:]))
        for field in SERVE_WORKER_SETTINGS:
            assert getattr(worker, field) == getattr(config.worker, field), field
    assert (worker.role, worker.group, worker.rank) == (WorkerRole.DECODE, "decode-1", 1)
    assert config.worker.grammar_limits == GrammarLimits(3.5, 0.25, 0.03, 1000, 10, 4096)
    api_server = from_args(
        ApiServerSettings, api_server_parser().parse_args(commands["api-server"][1:])
    )
    for field in set(SERVE_API_SERVER_SETTINGS) - {"api_key"}:
        assert getattr(api_server, field) == getattr(config.api_server, field), field
    assert api_server.model == worker.model == ModelSettings(str(config.model_dir), "chat", 100)
    assert (config.api_server.api_key, api_server.api_key) == ("secret", None)
    assert (api_server.embedding.served_model_name, api_server.fd) == ("vectors", 3)
    assert worker.logits_processors.paths == ("pkg.bans:Ban", "pkg.force:Force")
    assert api_server.logits_processors == worker.logits_processors  # the names to check


def test_serve_takes_every_device_the_worker_takes():
    assert serve_parser().parse_args(["--device", "cuda:1"]).device == "cuda:1"
    assert (
        serve_parser().parse_args([]).device
        == worker_parser().parse_args(["--scheduler-addr", "ipc://b"]).device
        == "auto"
    )


def test_a_bad_value_is_an_argparse_error_naming_its_flag(capsys: pytest.CaptureFixture[str]):
    for argv in (["--device", "gpu"], ["--kv-cache-memory", "lots"], ["--shutdown-timeout", "-1"]):
        with pytest.raises(SystemExit) as raised:
            serve_parser().parse_args(argv)
        assert raised.value.code == 2
        assert f"argument {argv[0]}: " in capsys.readouterr().err


@pytest.mark.parametrize("role", ["scheduler", "worker", "api_server", "serve"])
def test_help_lists_every_flag_with_its_default(role: str) -> None:
    parser = serve_parser() if role == "serve" else ROLE_PARSERS[role]()
    for name, action in options(parser).items():
        assert action.nargs == 0 or "default: " in action.help or "(required)" in action.help, name
    command = ["switchyard", "serve"] if role == "serve" else [role]
    shown = subprocess.run(
        [sys.executable, "-m", *command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    shown = "".join(shown.split())  # help wraps lines, hyphenated words too
    for name, action in options(parser).items():
        assert name in shown
        assert "".join((action.help % vars(action)).split()) in shown, name


def role_samples(media_dir: Path) -> dict[str, object]:
    """Settings of each role with a value other than the default in every field."""
    return {
        "scheduler": SchedulerSettings(
            "ipc://frontend",
            "tcp://127.0.0.1:5556",
            SAMPLE_SCHEDULING,
            WorkerLimits(64),
        ),
        "worker": WorkerSettings(
            ModelSettings("model.gguf", "name", 100),
            SchedulerAddress("ipc://backend"),
            *("cuda:1", 0.5, "float16", 32, "gathered", "high", 16, 3, 2),
            *(2, 1, "10.0.0.1", 1234, WorkerRole.DECODE, "decode-0", "tcp://10.0.0.1:7"),
            "/tmp/worker.alive",
            GrammarLimits(3.5, 0.25, 0.03, 1000, 10, 4096),
            LogitsProcessorSettings(("pkg.bans:Ban", "pkg.force:Force")),
            LoRASettings(True, 3, 8),
        ),
        "api_server": ApiServerSettings(
            ModelSettings("model", "name", 100),
            SchedulerAddress("ipc://frontend"),
            HttpBind("0.0.0.0", 9),
            3,
            EmbeddingModelSettings("minilm", "vectors"),
            *("key", ("https://a.example", "*"), 0.5, HttpLimits(1, 2, 3)),
            RequestLimits(4, 5, 6, 7),
            8,
            6,
            MediaConfig(media_dir, ("x.com", "y"), max_images_per_prompt=2),
            generation_config=str(media_dir),
            reasoning_parser="deepseek_r1",
            logits_processors=LogitsProcessorSettings(("pkg:Ban",)),
            responses_store=ResponseStoreConfig(str(media_dir / "responses"), 2.0, 5.0),
            allow_runtime_lora_updating=True,
        ),
    }


@pytest.mark.parametrize("role", ["scheduler", "worker", "api_server"])
def test_settings_survive_argv_and_back(role: str, tmp_path: Path, monkeypatch) -> None:
    """Settings → ``to_argv`` → the role's parser → ``from_args``: the same settings. A secret
    goes by its environment variable instead."""
    sample = role_samples(tmp_path.resolve())[role]
    monkeypatch.setenv("SWITCHYARD_API_KEY", "key")
    monkeypatch.delenv("SWITCHYARD_CURVE_KEYS_DIR", raising=False)
    parser = ROLE_PARSERS[role]()
    argv = to_argv(sample)
    assert from_args(type(sample), parser.parse_args(argv)) == sample
    common = argparse.ArgumentParser()
    add_transport_flags(common, binds=True)
    add_flags(common, LogSettings)
    secrets = {"--api-key"} if role == "api_server" else set()
    given = {arg for arg in argv if arg.startswith("--")}
    assert given | secrets == set(options(parser)) - set(options(common))  # every field differs
    assert not secrets & given
