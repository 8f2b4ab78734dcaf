"""``python -m api_server``: run one API server process.

    python -m api_server [--model DIR] [--embedding-model DIR [--embedding-model-name NAME]]
        --scheduler-addr ADDR [--served-model-name NAME]
        [--host 127.0.0.1] [--port 8000] [--fd N] [--max-model-len N] [--log-level LEVEL]
        [--api-key KEY] [--allowed-origins ORIGIN[,ORIGIN...]]... [--curve-keys-dir DIR]
        [--max-request-body-bytes N] [--max-header-count N] [--max-header-bytes N]
        [--max-prompt-bytes N] [--max-structured-output-bytes N] [--max-choices-per-request N]
        [--max-request-output-tokens N] [--max-stream-backlog N]
        [--shutdown-timeout SECONDS] [--log-format text|json]
        [--allowed-local-media-path DIR] [--allowed-media-domains HOST[,HOST...]]...
        [--max-images-per-prompt 8]

It serves a text generation model (``--model``), an embedding model (``--embedding-model``),
or both. ``--fd N`` serves on an already-listening socket inherited as file descriptor N, so
that the launcher can bind one port and start several API servers on it. SIGTERM drains before
exiting (``api_server.shutdown``). The API key defaults to
$SWITCHYARD_API_KEY, which is how the launcher passes it (a flag would show in ``ps``). Chat
images come as data URLs, and as ``file://`` URLs inside ``--allowed-local-media-path`` and
http(s) URLs from the hosts ``--allowed-media-domains`` names (``api_server.images``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import setproctitle
import uvicorn

from api_server.app import create_app
from api_server.bind_address import listening_host, warn_if_exposed
from api_server.config import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    ApiServerConfig,
    EngineClientConfig,
    HttpLimits,
    add_limit_flags,
    add_media_flags,
    media_config,
    request_limits,
    resolve_max_model_len,
    split_commas,
)
from api_server.limits import uvicorn_options
from api_server.shutdown import DrainingServer
from interfaces import envs
from interfaces.logs import add_log_flags, configure_logging
from interfaces.transport import add_transport_flags, transport_from_args

PROCESS_TITLE = "switchyard-api-server"
CONNECTION_CLOSE_TIMEOUT_S = 5
"""After draining, how long uvicorn waits for responses to finish writing."""
logger = logging.getLogger("api_server")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m api_server",
        description="Run one Switchyard API server process (OpenAI API in front of the scheduler).",
    )
    parser.add_argument(
        "--model", help="Hugging Face-format directory of the chat and completion model"
    )
    parser.add_argument("--scheduler-addr", required=True, help="the scheduler's ZeroMQ address")
    parser.add_argument("--served-model-name", help="model name clients use (default: DIR's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fd", type=int, help="serve on this inherited listening socket")
    parser.add_argument("--max-model-len", type=int, help="prompt plus output tokens at most")
    parser.add_argument(
        "--embedding-model",
        help="also serve /v1/embeddings with this model directory (an embedding worker runs it)",
    )
    parser.add_argument("--embedding-model-name", help="its name for clients (default: DIR's)")
    parser.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="require 'Authorization: Bearer KEY' (default: $SWITCHYARD_API_KEY; prefer it)",
    )
    parser.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        help="CORS origins, comma-separated or repeated ('*': any); default: CORS off",
    )
    add_limit_flags(parser)
    add_media_flags(parser)
    parser.add_argument(
        "--shutdown-timeout",
        type=non_negative_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds to let requests in flight finish before aborting them "
        "(default: %(default)s; 0 aborts at once)",
    )
    add_log_flags(parser)
    add_transport_flags(parser, binds=False)
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> ApiServerConfig:
    """The process's config; ``ValueError`` with a message for the user on a bad model path."""
    envs.shm_namespace()  # a malformed SWITCHYARD_SHM_NAMESPACE fails here, not per image
    model_dir = served_model_name = max_model_len = None
    if args.model is not None:
        model_dir = _generation_model_dir(args.model)
        served_model_name = args.served_model_name or model_dir.resolve().name
        max_model_len = resolve_max_model_len(model_dir, args.max_model_len)
    elif args.served_model_name is not None or args.max_model_len is not None:
        raise ValueError("--served-model-name and --max-model-len describe --model; give it")
    embedding_model_dir = None
    if args.embedding_model is not None:
        embedding_model_dir = Path(args.embedding_model).expanduser()
        if not (embedding_model_dir / "tokenizer.json").is_file():
            raise ValueError(f"--embedding-model {embedding_model_dir} has no tokenizer.json")
    elif args.embedding_model_name is not None:
        raise ValueError("--embedding-model-name names --embedding-model; give it")
    return ApiServerConfig(
        embedding_model_dir=embedding_model_dir,
        embedding_model_name=args.embedding_model_name,
        model_dir=model_dir,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        engine=EngineClientConfig(
            args.scheduler_addr,
            transport_from_args(args),
            max_stream_backlog=args.max_stream_backlog,
        ),
        api_key=args.api_key or None,
        allowed_origins=split_commas(args.allowed_origins),
        limits=HttpLimits(
            max_request_body_bytes=args.max_request_body_bytes,
            max_header_count=args.max_header_count,
            max_header_bytes=args.max_header_bytes,
        ),
        media=media_config(args),
        request_limits=request_limits(args),
    )


def _generation_model_dir(model: str) -> Path:
    model_dir = Path(model).expanduser()
    if model_dir.suffix == ".gguf":
        raise ValueError(
            f"{model_dir} is a GGUF file; the API server needs the Hugging Face-format directory "
            "converted from it. `switchyard serve` converts it (or run "
            "`python -m worker.model_files FILE.gguf` and pass the directory it prints)."
        )
    if not model_dir.is_dir():
        raise ValueError(f"--model {model_dir} is not a directory")
    return model_dir


def non_negative_seconds(text: str) -> float:
    """argparse type: a number of seconds, 0 or more."""
    seconds = float(text)
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("api-server", args.log_level, args.log_format)
    setproctitle.setproctitle(PROCESS_TITLE)
    try:
        config = build_config(args)
        bind_host = listening_host(args.host, args.fd)
        if args.fd is None:  # with --fd, `switchyard serve` bound the socket and warned
            warn_if_exposed(bind_host, config.api_key)
        app = create_app(config, bind_host)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    where = {"fd": args.fd} if args.fd is not None else {"host": args.host, "port": args.port}
    # After a second signal uvicorn restores the handlers it found and re-raises the signal.
    # With these no-op handlers found, the re-raise ends nothing, so even that exits 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: None)
    server_config = uvicorn.Config(
        app,
        log_config=None,  # uvicorn's loggers go through ours (configure_logging)
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=CONNECTION_CLOSE_TIMEOUT_S,
        **uvicorn_options(config.limits),
        **where,
    )
    DrainingServer(server_config, app, args.shutdown_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
