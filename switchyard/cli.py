"""The ``switchyard`` command: ``serve`` runs everything; ``prepare-model`` converts a model."""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from setproctitle import setproctitle

from api_server.bind_address import warn_if_exposed
from api_server.config import EmbeddingModelSettings
from interfaces import envs
from interfaces.curve_keys import FILES_BY_PROCESS
from interfaces.logs import configure_logging
from interfaces.settings import add_flags, from_args, split_commas
from interfaces.shared_settings import LoRASettings, ModelSettings
from interfaces.transport import generate_curve_keys
from scheduler.config import SchedulerConfig
from switchyard.launcher import Launcher
from switchyard.serve_config import ServeConfig, check_lora_adapters
from worker.model_files import model_name_for

logger = logging.getLogger("switchyard")
NO_MODEL = "none"
"""``serve --model none``: no text generation model (serve only ``--embedding-model``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Switchyard LLM server")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model over the OpenAI API")
    add_flags(serve, ModelSettings)
    add_flags(serve, EmbeddingModelSettings)
    add_flags(serve, ServeConfig)

    keygen = commands.add_parser(
        "keygen",
        help="create a CURVE key pair per role (scheduler, API servers, workers, KV transfers) "
        "for ZeroMQ traffic between hosts (--curve-keys-dir)",
    )
    keygen.add_argument(
        "--output",
        required=True,
        help="directory for the key files: created (0700) if missing; an existing one must be "
        "yours, writable by no one else, and hold none of the files",
    )

    prepare = commands.add_parser(
        "prepare-model", help="convert a model (e.g. GGUF) once and print its directory"
    )
    add_flags(prepare, ModelSettings, only=("path",))
    add_flags(prepare, SchedulerConfig, only=("lora_modules",))
    add_flags(prepare, LoRASettings, only=("max_lora_rank",))
    prepare.add_argument("--output", help="also copy the prepared directory here")
    return parser


def prepare_model(
    model: str | None, lora: SchedulerConfig | None = None, max_lora_rank: int = 0
) -> Path:
    """Resolve ``model`` to a Hugging Face directory, converting and caching it if needed; with
    ``lora``'s ``--lora-modules``, check that each adapter fits it (``ValueError``)."""
    from worker.model_files import resolve_model  # torch and transformers: only when needed

    model_dir = resolve_model(model)
    if lora is not None:
        check_lora_adapters(model_dir, lora.lora_adapters, max_lora_rank)
    return model_dir


def _prepare_in_child(model: str | None, args: argparse.Namespace) -> Path:
    """Run ``prepare-model`` in a child so the launcher never holds torch in memory (it checks
    ``--lora-modules`` adapters against the model there too)."""
    argv = [sys.executable, "-m", "switchyard", "prepare-model"]
    if model is not None:
        argv += ["--model", model]
    if args.lora_modules:
        argv += ["--lora-modules", ",".join(args.lora_modules)]
        argv += ["--max-lora-rank", str(args.max_lora_rank)]
    completed = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(completed.returncode)
    return Path(completed.stdout.strip().splitlines()[-1])


def serve(args: argparse.Namespace) -> int:
    # Like every role, the launcher shows its role in ps; this also keeps --api-key out of it.
    setproctitle("switchyard-launcher")
    model = from_args(ModelSettings, args)
    model_dir = served_model_name = None
    if (model.path or "").lower() != NO_MODEL:
        model_dir = _prepare_in_child(model.path, args)
        served_model_name = model.served_model_name or model_name_for(model.path)
    elif model.served_model_name is not None or model.max_model_len is not None:
        raise ValueError("--served-model-name and --max-model-len describe --model, which is none")
    config = from_args(
        ServeConfig,
        args,
        model_dir=model_dir,
        served_model_name=served_model_name,
        max_model_len=model.max_model_len,
        **_embedding_model(from_args(EmbeddingModelSettings, args)),
    )
    warn_if_exposed(config.bind.host, config.api_key)
    launcher = Launcher(config)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: launcher.stop())
    try:
        launcher.start()
        if launcher.dead_child() is None:
            print(
                f"switchyard: serving {config.model_names} on "
                f"http://{config.bind.host}:{launcher.port}",
                flush=True,
            )
        return launcher.wait()
    finally:
        launcher.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(
        "launcher",
        getattr(args, "log_level", envs.log_level()),
        getattr(args, "log_format", envs.log_format()),
    )
    try:
        if args.command == "keygen":
            generate_curve_keys(Path(args.output))
            print(f"switchyard: CURVE keys written to {args.output}; each host needs:", flush=True)
            for process, names in FILES_BY_PROCESS.items():
                print(f"  {process}: {', '.join(names)}", flush=True)
            return 0
        if args.command == "prepare-model":
            lora = SchedulerConfig(lora_modules=split_commas(args.lora_modules))
            model_dir = prepare_model(args.model, lora, args.max_lora_rank)
            if args.output:
                shutil.copytree(model_dir, args.output, dirs_exist_ok=True)
                model_dir = Path(args.output)
            print(model_dir, flush=True)
            return 0
        return serve(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"switchyard: error: {error}", file=sys.stderr)
        return 2


def _embedding_model(given: EmbeddingModelSettings) -> dict:
    """ServeConfig's embedding fields for ``--embedding-model`` (none without it)."""
    name_or_path, served_name = given.path, given.served_model_name
    if name_or_path is None:
        if served_name is not None:
            raise ValueError("--embedding-model-name names --embedding-model; give it")
        return {}
    from interfaces.embeddings import DEFAULT_EMBEDDING_MODEL, default_embedding_model_dir

    if name_or_path == "default":
        path, name = default_embedding_model_dir(), DEFAULT_EMBEDDING_MODEL
    else:
        path = Path(name_or_path).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"--embedding-model {path} is not a model directory (no config.json)")
        name = path.resolve().name
    return {"embedding_model_dir": path, "embedding_model_name": served_name or name}


if __name__ == "__main__":
    sys.exit(main())
