"""Fixtures the scheduler's tests share: a scheduler running on real sockets."""

from __future__ import annotations

import threading

import pytest
import zmq

from scheduler.config import SchedulerConfig
from scheduler.server import SchedulerServer
from tests.support.scheduler_sockets import FakeWorkerThread


@pytest.fixture
def system(request, tmp_path):
    """A running SchedulerServer plus a zmq context; yields (server, context, frontend, backend).
    Parametrized indirectly, its param is a dict of ``SchedulerConfig`` fields to change."""
    frontend, backend = f"ipc://{tmp_path}/frontend", f"ipc://{tmp_path}/backend"
    fields = {"max_num_batched_tokens": 32, **getattr(request, "param", {})}
    server = SchedulerServer(SchedulerConfig(**fields), frontend, backend)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    context = zmq.Context()
    yield server, context, frontend, backend
    server.stop()  # sends the fake worker Shutdown
    thread.join(timeout=5)
    assert not thread.is_alive()
    for worker in threading.enumerate():
        if isinstance(worker, FakeWorkerThread):
            worker.join(timeout=5)
    context.destroy(linger=0)
