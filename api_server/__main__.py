"""``python -m api_server``: run one API server process.

    python -m api_server [--model DIR] [--embedding-model DIR] --scheduler-addr ADDR [...]

Its flags (``--help`` lists them with their defaults) are the fields of ``ApiServerSettings``.
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
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import setproctitle
import uvicorn

from api_server.app import create_app
from api_server.bind_address import inherited_listener, listening_host, warn_if_exposed
from api_server.config import (
    ApiServerConfig,
    ApiServerSettings,
    EngineClientConfig,
    resolve_max_model_len,
)
from api_server.generation_config import (
    AUTO,
    NO_DEFAULTS,
    generation_limit,
    load_generation_defaults,
)
from api_server.limits import uvicorn_options
from api_server.shutdown import DrainingServer
from interfaces import envs
from interfaces.logs import LogSettings, configure_logging
from interfaces.settings import add_flags, from_args
from interfaces.transport import add_transport_flags, transport_from_args

PROCESS_TITLE = "switchyard-api-server"
CONNECTION_CLOSE_TIMEOUT_S = 5
"""After draining, how long uvicorn waits for responses to finish writing."""
logger = logging.getLogger("api_server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m api_server",
        description="Run one Switchyard API server process (OpenAI API in front of the scheduler).",
    )
    add_flags(parser, ApiServerSettings)
    add_flags(parser, LogSettings)
    add_transport_flags(parser, binds=False)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_config(args: argparse.Namespace) -> ApiServerConfig:
    """The process's config; ``ValueError`` with a message for the user on a bad model path."""
    settings = from_args(ApiServerSettings, args)
    envs.shm_namespace()  # a malformed SWITCHYARD_SHM_NAMESPACE fails here, not per image
    model, embedding = settings.model, settings.embedding
    model_dir = served_model_name = max_model_len = None
    generation_defaults, max_new_tokens_limit = NO_DEFAULTS, None
    if model.path is not None:
        model_dir = _generation_model_dir(model.path)
        served_model_name = model.served_model_name or model_dir.resolve().name
        max_model_len = resolve_max_model_len(model_dir, model.max_model_len)
        generation_defaults = load_generation_defaults(
            model_dir, settings.generation_config, log=True
        )
        max_new_tokens_limit = generation_limit(generation_defaults, settings.generation_config)
    elif model.served_model_name is not None or model.max_model_len is not None:
        raise ValueError("--served-model-name and --max-model-len describe --model; give it")
    elif settings.generation_config != AUTO:
        raise ValueError("--generation-config describes --model; give it")
    elif settings.reasoning_parser is not None:
        raise ValueError("--reasoning-parser parses --model's output; give it")
    embedding_model_dir = None
    if embedding.path is not None:
        embedding_model_dir = Path(embedding.path).expanduser()
        if not (embedding_model_dir / "tokenizer.json").is_file():
            raise ValueError(f"--embedding-model {embedding_model_dir} has no tokenizer.json")
    elif embedding.served_model_name is not None:
        raise ValueError("--embedding-model-name names --embedding-model; give it")
    return ApiServerConfig(
        embedding_model_dir=embedding_model_dir,
        embedding_model_name=embedding.served_model_name,
        model_dir=model_dir,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        engine=EngineClientConfig(
            settings.scheduler.address,
            transport_from_args(args),
            max_stream_backlog=settings.max_stream_backlog,
            scheduler_return_timeout_s=settings.scheduler_return_timeout_s,
        ),
        api_key=settings.api_key or None,
        allowed_origins=settings.allowed_origins,
        limits=settings.limits,
        media=settings.media,
        request_limits=settings.request_limits,
        generation_defaults=generation_defaults,
        max_new_tokens_limit=max_new_tokens_limit,
        reasoning_parser=settings.reasoning_parser,
        logits_processor_names=settings.logits_processors.names,
        responses_store=settings.responses_store,
        allow_runtime_lora_updating=settings.allow_runtime_lora_updating,
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


def main(argv: list[str] | None = None) -> int:
    # Until the server runs, a SIGTERM/SIGINT is noted rather than fatal: a process stopped
    # while it starts (a pod scaled down while loading, a sibling on the same socket already
    # ready) exits 0 once its start-up work ends, without serving.
    stop_signals: list[int] = []
    _route_stop_signals(lambda signum, _frame: stop_signals.append(signum))
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
    server_config = uvicorn.Config(
        app,
        log_config=None,  # uvicorn's loggers go through ours (configure_logging)
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=CONNECTION_CLOSE_TIMEOUT_S,
        **uvicorn_options(config.limits),
        **where,
    )
    server = DrainingServer(server_config, app, args.shutdown_timeout)
    # From here a signal goes to the server, which uvicorn then captures while it serves; a
    # signal before that makes it stop as soon as it has started. Once it has served, uvicorn
    # restores the handler it found (this one) and re-raises each signal it captured: the
    # finished server takes them, so even a second signal exits 0.
    _route_stop_signals(server.handle_exit)
    if stop_signals:
        logger.info("received %s while starting; not serving", signal.Signals(stop_signals[0]).name)
        return 0
    serve(server, args.fd)
    return 1 if server.refused else 0


def serve(server: uvicorn.Server, fd: int | None) -> None:
    """Run ``server``, on the listening socket inherited as ``fd`` when there is one: as a
    socket object (``inherited_listener``: TCP_NODELAY on its connections), the ``fd`` of the
    server's config only naming it in uvicorn's start-up line."""
    server.run(sockets=None if fd is None else [inherited_listener(fd)])


def _route_stop_signals(handler: Callable[[int, FrameType | None], object]) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
