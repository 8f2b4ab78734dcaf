"""``python -m scheduler``: run the scheduler process alone (one container role)."""

from __future__ import annotations

import argparse
import signal

import zmq
from setproctitle import setproctitle

from interfaces.logs import LogSettings, configure_logging
from interfaces.settings import add_flags, from_args
from interfaces.transport import add_transport_flags, transport_from_args
from scheduler.config import SchedulerSettings
from scheduler.server import SchedulerServer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description=__doc__)
    add_flags(parser, SchedulerSettings)
    add_transport_flags(parser, binds=True)
    add_flags(parser, LogSettings)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setproctitle("switchyard-scheduler")
    configure_logging("scheduler", args.log_level, args.log_format)
    try:
        settings = from_args(SchedulerSettings, args)
        server = SchedulerServer(
            settings.scheduling,
            settings.frontend_addr,
            settings.backend_addr,
            transport_from_args(args),
            settings.worker_limits,
        )
    except (ValueError, zmq.ZMQError) as error:
        raise SystemExit(f"switchyard-scheduler: {error}") from None
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.stop())
    server.run()


if __name__ == "__main__":
    main()
