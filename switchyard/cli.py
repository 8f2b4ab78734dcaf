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
from api_server.config import (
    add_limit_flags,
    add_media_flags,
    limit_flags,
    media_domains,
    media_path,
    split_commas,
)
from interfaces import envs
from interfaces.curve_keys import FILES_BY_PROCESS
from interfaces.logs import add_log_flags, configure_logging
from interfaces.transport import generate_curve_keys
from scheduler.config import SchedulerConfig, add_kv_transfer_flag, add_queue_flags
from switchyard.launcher import Launcher
from switchyard.serve_config import DEFAULT_BLOCK_SIZE, ServeConfig
from worker.grammar_limits import add_grammar_flags, grammar_flags, grammar_limits_from_args
from worker.model_files import model_name_for

logger = logging.getLogger("switchyard")
NO_MODEL = "none"
"""``serve --model none``: no text generation model (serve only ``--embedding-model``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Switchyard LLM server")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model over the OpenAI API")
    _add_model_flag(serve, none_allowed=True)
    serve.add_argument("--served-model-name", help="model name clients use (default: derived)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    serve.add_argument("--api-servers", type=int, default=1, help="API server processes")
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="worker processes that split the model (one per GPU on CUDA), in each group",
    )
    serve.add_argument(
        "--embedding-model",
        metavar="NAME_OR_PATH",
        help="also serve /v1/embeddings with this encoder model directory ('default': the "
        "packaged all-MiniLM-L6-v2)",
    )
    serve.add_argument(
        "--embedding-model-name", help="the embedding model's name for clients (default: derived)"
    )
    serve.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="disaggregate: this many prefill worker groups (with --decode-workers)",
    )
    serve.add_argument(
        "--decode-workers",
        type=int,
        default=0,
        help="disaggregate: this many decode worker groups (with --prefill-workers)",
    )
    add_kv_transfer_flag(serve)
    add_grammar_flags(serve)
    add_log_flags(serve)
    serve.add_argument("--max-model-len", type=int, help="context length (default: model's)")
    serve.add_argument(
        "--kv-cache-memory",
        help="KV cache size: bytes with an optional unit (2GiB), or a fraction of free memory",
    )
    serve.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV cache block"
    )
    serve.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="most requests per step",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="token budget per step (prefill chunks and decodes); raise it on a GPU",
    )
    serve.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse the KV blocks of identical prompt prefixes",
    )
    serve.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $SWITCHYARD_API_KEY, which keeps the key out of `ps`)",
    )
    serve.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        help="CORS origins, comma-separated or repeated ('*': any); default: CORS off",
    )
    serve.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=ServeConfig.shutdown_timeout_s,
        help="on SIGTERM, seconds to let requests in flight finish before aborting them "
        "(default: %(default)s; 0 aborts at once)",
    )
    add_queue_flags(serve)
    add_limit_flags(serve)
    add_media_flags(serve)

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
    _add_model_flag(prepare)
    prepare.add_argument("--output", help="also copy the prepared directory here")
    return parser


def _add_model_flag(parser: argparse.ArgumentParser, none_allowed: bool = False) -> None:
    help_text = "Hugging Face-format directory or .gguf file (default: SmolLM2-135M-Instruct)"
    if none_allowed:
        help_text += "; 'none' serves only --embedding-model (./none names a directory)"
    parser.add_argument("--model", help=help_text)


def prepare_model(model: str | None) -> Path:
    """Resolve ``model`` to a Hugging Face directory, converting and caching it if needed."""
    from worker.model_files import resolve_model  # torch and transformers: only when needed

    return resolve_model(model)


def _prepare_in_child(model: str | None) -> Path:
    """Run ``prepare-model`` in a child so the launcher never holds torch in memory."""
    argv = [sys.executable, "-m", "switchyard", "prepare-model"]
    if model is not None:
        argv += ["--model", model]
    completed = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if completed.returncode != 0:
        raise SystemExit(completed.returncode)
    return Path(completed.stdout.strip().splitlines()[-1])


def serve(args: argparse.Namespace) -> int:
    # Like every role, the launcher shows its role in ps; this also keeps --api-key out of it.
    setproctitle("switchyard-launcher")
    model_dir = served_model_name = None
    if (args.model or "").lower() != NO_MODEL:
        model_dir = _prepare_in_child(args.model)
        served_model_name = args.served_model_name or model_name_for(args.model)
    elif args.served_model_name is not None or args.max_model_len is not None:
        raise ValueError("--served-model-name and --max-model-len describe --model, which is none")
    config = ServeConfig(
        model_dir=model_dir,
        served_model_name=served_model_name,
        host=args.host,
        port=args.port,
        api_servers=args.api_servers,
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_workers=args.prefill_workers,
        **_embedding_model(args.embedding_model, args.embedding_model_name),
        decode_workers=args.decode_workers,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        api_key=args.api_key or None,
        allowed_origins=split_commas(args.allowed_origins),
        allowed_local_media_path=media_path(args.allowed_local_media_path),
        allowed_media_domains=media_domains(args.allowed_media_domains),
        max_images_per_prompt=args.max_images_per_prompt,
        shutdown_timeout_s=args.shutdown_timeout,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        api_server_flags=limit_flags(args),
        worker_flags=tuple(grammar_flags(grammar_limits_from_args(args))),
        log_level=args.log_level,
        log_format=args.log_format,
    )
    warn_if_exposed(config.host, config.api_key)
    launcher = Launcher(config)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: launcher.stop())
    try:
        launcher.start()
        if launcher.dead_child() is None:
            print(
                f"switchyard: serving {config.model_names} on http://{config.host}:{launcher.port}",
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
            model_dir = prepare_model(args.model)
            if args.output:
                shutil.copytree(model_dir, args.output, dirs_exist_ok=True)
                model_dir = Path(args.output)
            print(model_dir, flush=True)
            return 0
        return serve(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"switchyard: error: {error}", file=sys.stderr)
        return 2


def _embedding_model(name_or_path: str | None, served_name: str | None) -> dict:
    """ServeConfig's embedding fields for ``--embedding-model`` (none without it)."""
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
