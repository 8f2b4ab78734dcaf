"""``python -m worker``: load a model and serve it to the scheduler, alone or as one rank of a
tensor-parallel group (``--tensor-parallel-size N --rank R``; the ranks meet at
``--master-addr``:``--master-port``, where rank 0 listens), in a ``--role``: hybrid (the
default), or prefill or decode for disaggregated serving."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import setproctitle
import torch
import torch.distributed as dist

from interfaces.logs import LogSettings, configure_logging
from interfaces.settings import add_flags, from_args
from interfaces.transport import add_transport_flags, is_loopback, transport_from_args
from interfaces.worker_to_scheduler import WorkerRole
from worker.config import WorkerConfig, default_num_threads
from worker.model_files import model_name_for, resolve_model
from worker.model_runner import ModelRunner
from worker.parallel import GroupBroken, destroy_tensor_parallel, init_tensor_parallel
from worker.server import WorkerServer
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from worker.embeddings import EmbeddingsGenerator

logger = logging.getLogger("worker")

PROCESS_TITLE = "switchyard-worker tp{rank}"
"""What ``ps`` shows for a worker: its rank, then its group's name if it was given one (as
``switchyard serve`` does: ``switchyard-worker tp0 prefill-0``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    add_flags(parser, WorkerSettings)
    add_transport_flags(parser, binds=True)
    add_flags(parser, LogSettings)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the model, then serve until Shutdown or a signal. Returns the exit code."""
    args = parse_args(argv)
    title = PROCESS_TITLE.format(rank=args.rank)
    setproctitle.setproctitle(f"{title} {args.group}" if args.group else title)
    configure_logging(f"worker-tp{args.rank}", args.log_level, args.log_format)
    # A bar per load is noise in a server's log; read where transformers is first imported
    # (only for what needs it: an embedding model, a GGUF conversion, a grammar's tokenizer).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_while_loading)
    try:
        security = transport_from_args(args)  # before the model: bad keys fail fast
        settings = from_args(WorkerSettings, args)
        config = _config(settings)
        init_tensor_parallel(
            config.rank,
            config.tensor_parallel_size,
            config.master_addr,
            config.master_port,
            config.torch_device,
        )
        runner = _runner(settings.role, config)
    except (ValueError, dist.DistError, GroupBroken) as error:
        logger.error("cannot start the worker: %s", error)
        return 1
    server = WorkerServer(
        runner,
        settings.scheduler.address,
        security,
        settings.role,
        settings.group or _default_group(settings),
        settings.kv_transfer_addr,
        Path(settings.liveness_file) if settings.liveness_file else None,
    )
    code = server.serve()
    if code == 0:  # a broken group's communicators may block in teardown: the exit frees them
        destroy_tensor_parallel()
    return code


def _config(settings: WorkerSettings) -> WorkerConfig:
    return WorkerConfig(
        model_dir=resolve_model(settings.model.path),
        device=settings.device,
        dtype=settings.dtype,
        kv_cache_memory=settings.kv_cache_memory,
        block_size=settings.block_size,
        attention_backend=settings.attention_backend,
        float32_matmul_precision=settings.float32_matmul_precision,
        max_cudagraph_capture_size=settings.max_cudagraph_capture_size,
        max_model_len=settings.model.max_model_len,
        seed=settings.seed,
        served_model_name=settings.model.served_model_name or model_name_for(settings.model.path),
        num_threads=settings.num_threads,
        rank=settings.rank,
        tensor_parallel_size=settings.tensor_parallel_size,
        master_addr=settings.master_addr,
        master_port=settings.master_port,
        grammar_limits=settings.grammar_limits,
        logits_processors=settings.logits_processors.paths,
        lora=settings.lora,
    )


def _runner(role: WorkerRole, config: WorkerConfig) -> ModelRunner | EmbeddingsGenerator:
    """The model this worker serves: a generator, or for ``embedding`` an encoder."""
    if role is not WorkerRole.EMBEDDING:
        return ModelRunner(config)
    from worker.embeddings import EmbeddingsGenerator  # transformers: only for an encoder

    if config.tensor_parallel_size > 1:
        raise ValueError("an embedding worker runs on one rank (--tensor-parallel-size 1)")
    if config.lora.enable_lora:
        raise ValueError("an embedding worker serves no LoRA adapters (drop --enable-lora)")
    if config.torch_device.type == "cpu":
        torch.set_num_threads(config.num_threads or default_num_threads())
    return EmbeddingsGenerator(config.model_dir, config.torch_device, config.model_name)


def _default_group(settings: WorkerSettings) -> str:
    """The group's name when ``--group`` is not given, alike on its ranks and unique among
    groups without configuration (``docker compose up --scale worker=3``: each container has a
    host name of its own): a one-rank worker's host and pid; a tensor-parallel group's
    rendezvous, which its ranks share and only they do, with the host's name for a loopback
    address (every host's own)."""
    role, host = settings.role.value, socket.gethostname()
    if settings.tensor_parallel_size == 1:
        return f"{role}@{host}:{os.getpid()}"
    if not is_loopback(settings.master_addr):
        host = settings.master_addr
    return f"{role}@{host}:{settings.master_port}"


def _exit_while_loading(signum: int, _frame: FrameType | None) -> None:
    """A signal before serving: unwind (so a half-built GGUF conversion is removed) and exit."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
