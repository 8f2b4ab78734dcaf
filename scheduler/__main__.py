"""``python -m scheduler``: run the scheduler process alone (one container role)."""

from __future__ import annotations

import argparse
import signal

import zmq
from setproctitle import setproctitle

from interfaces.logs import add_log_flags, configure_logging
from interfaces.transport import add_transport_flags, transport_from_args
from scheduler.config import (
    SchedulerConfig,
    WorkerLimits,
    add_kv_transfer_flag,
    add_queue_flags,
    add_worker_limit_flags,
)
from scheduler.server import SchedulerServer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__)
    parser.add_argument(
        "--frontend-addr",
        required=True,
        help="ZeroMQ address API servers connect to, e.g. ipc:///tmp/sy/frontend",
    )
    parser.add_argument(
        "--backend-addr",
        required=True,
        help="ZeroMQ address workers connect to, e.g. tcp://127.0.0.1:5556",
    )
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="do not reuse the KV blocks of identical prompt prefixes",
    )
    add_kv_transfer_flag(parser)
    add_queue_flags(parser)
    add_worker_limit_flags(parser)
    add_transport_flags(parser, binds=True)
    add_log_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setproctitle("switchyard-scheduler")
    configure_logging("scheduler", args.log_level, args.log_format)
    try:
        config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
            max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens,
            kv_transfer_timeout_s=args.kv_transfer_timeout,
        )
        security = transport_from_args(args)
        limits = WorkerLimits(max_kv_blocks=args.max_worker_kv_blocks)
        server = SchedulerServer(config, args.frontend_addr, args.backend_addr, security, limits)
    except (ValueError, zmq.ZMQError) as error:
        raise SystemExit(f"switchyard-scheduler: {error}") from None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    server.run()


if __name__ == "__main__":
    main()
