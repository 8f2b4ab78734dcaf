"""``python -m scheduler``: run the scheduler process alone (one container role)."""

from __future__ import annotations

import argparse
import logging
import signal

from setproctitle import setproctitle

from interfaces import envs
from scheduler.config import SchedulerConfig
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setproctitle("switchyard-scheduler")
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s scheduler %(name)s: %(message)s"
    )
    try:
        config = SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, args.enable_prefix_caching
        )
    except ValueError as error:
        raise SystemExit(f"switchyard-scheduler: {error}") from None
    server = SchedulerServer(config, args.frontend_addr, args.backend_addr)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    server.run()


if __name__ == "__main__":
    main()
