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
from types import FrameType

import setproctitle
import torch
import torch.distributed as dist
from transformers.utils import logging as transformers_logging

from interfaces.logs import add_log_flags, configure_logging
from interfaces.transport import add_transport_flags, transport_from_args
from interfaces.worker_to_scheduler import WorkerRole
from worker.config import DTYPES, WorkerConfig, default_num_threads, parse_memory
from worker.embeddings import EmbeddingsGenerator
from worker.grammar_limits import add_grammar_flags, grammar_limits_from_args
from worker.model_files import model_name_for, resolve_model
from worker.model_runner import ModelRunner
from worker.parallel import GroupBroken, destroy_tensor_parallel, init_tensor_parallel
from worker.server import WorkerServer

logger = logging.getLogger("worker")

PROCESS_TITLE = "switchyard-worker tp{rank}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M)"
    )
    parser.add_argument(
        "--scheduler-addr", required=True, help="the scheduler's backend ROUTER address"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_memory,
        default=None,
        help="KV cache bytes (4294967296, 512MiB, 2GiB) or a fraction of free memory (0.8)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--seed", type=int, default=None, help="seed for unseeded requests")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="CPU threads (default: every core)"
    )
    group = parser.add_argument_group("tensor parallelism")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks in the group")
    group.add_argument("--rank", type=int, default=0, help="this worker's rank in the group")
    group.add_argument(
        "--master-addr", default="127.0.0.1", help="the host of rank 0, where the ranks meet"
    )
    group.add_argument("--master-port", type=int, default=29500, help="rank 0's rendezvous port")
    group = parser.add_argument_group("disaggregation")
    group.add_argument(
        "--role",
        type=WorkerRole,
        default=WorkerRole.HYBRID,
        choices=list(WorkerRole),
        metavar="{" + ",".join(role.value for role in WorkerRole) + "}",
        help="hybrid runs whole requests; prefill and decode groups split them; embedding "
        "serves an encoder model's vectors (default: hybrid)",
    )
    group.add_argument(
        "--group",
        default=None,
        help="the worker group's name, alike on its ranks and unique among groups (default: "
        "the role and, with tensor parallelism, the rendezvous address; else host and pid)",
    )
    group.add_argument(
        "--kv-transfer-addr",
        default="tcp://127.0.0.1:*",
        help="a decode rank receives KV blocks here; prefill ranks connect to it, so on "
        "several hosts give an address they reach (tcp://HOST:PORT, or :* for a free port)",
    )
    add_grammar_flags(parser)
    add_transport_flags(parser, binds=True)
    add_log_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the model, then serve until Shutdown or a signal. Returns the exit code."""
    args = parse_args(argv)
    setproctitle.setproctitle(PROCESS_TITLE.format(rank=args.rank))
    configure_logging(f"worker-tp{args.rank}", args.log_level, args.log_format)
    transformers_logging.disable_progress_bar()  # a bar per load is noise in a server's log
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_while_loading)
    try:
        security = transport_from_args(args)  # before the model: bad keys fail fast
        config = _config(args)
        init_tensor_parallel(
            config.rank,
            config.tensor_parallel_size,
            config.master_addr,
            config.master_port,
            config.torch_device,
        )
        runner = _runner(args.role, config)
    except (ValueError, dist.DistError, GroupBroken) as error:
        logger.error("cannot start the worker: %s", error)
        return 1
    server = WorkerServer(
        runner,
        args.scheduler_addr,
        security,
        args.role,
        args.group or _default_group(args),
        args.kv_transfer_addr,
    )
    code = server.serve()
    if code == 0:  # a broken group's communicators may block in teardown: the exit frees them
        destroy_tensor_parallel()
    return code


def _config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        model_dir=resolve_model(args.model),
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        served_model_name=args.served_model_name or model_name_for(args.model),
        num_threads=args.num_threads,
        rank=args.rank,
        tensor_parallel_size=args.tensor_parallel_size,
        master_addr=args.master_addr,
        master_port=args.master_port,
        grammar_limits=grammar_limits_from_args(args),
    )


def _runner(role: WorkerRole, config: WorkerConfig) -> ModelRunner | EmbeddingsGenerator:
    """The model this worker serves: a generator, or for ``embedding`` an encoder."""
    if role is not WorkerRole.EMBEDDING:
        return ModelRunner(config)
    if config.tensor_parallel_size > 1:
        raise ValueError("an embedding worker runs on one rank (--tensor-parallel-size 1)")
    if config.torch_device.type == "cpu":
        torch.set_num_threads(config.num_threads or default_num_threads())
    return EmbeddingsGenerator(config.model_dir, config.torch_device, config.model_name)


def _default_group(args: argparse.Namespace) -> str:
    if args.tensor_parallel_size > 1:  # the ranks share their rendezvous, and only they do
        return f"{args.role.value}@{args.master_addr}:{args.master_port}"
    return f"{args.role.value}@{socket.gethostname()}:{os.getpid()}"


def _exit_while_loading(signum: int, _frame: FrameType | None) -> None:
    """A signal before serving: unwind (so a half-built GGUF conversion is removed) and exit."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
