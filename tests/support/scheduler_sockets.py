"""A scheduler's sockets as its peers see them: a fake worker thread, fake API server clients
and what they read back."""

from __future__ import annotations

import threading
import time

import zmq

from interfaces import (
    TextContext,
    msgpack_numpy_decoder,
    msgpack_numpy_encoder,
)
from interfaces.api_to_scheduler import StatsRequest
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_api import SchedulerResults, SchedulerToApiMessage
from interfaces.scheduler_to_worker import ScheduledStep, SchedulerToWorkerMessage, Shutdown
from interfaces.worker_to_scheduler import WorkerFailure, WorkerOutput, WorkerReady
from tests.support.fake_worker import FakeTokenGenerator, next_token_for

TIMEOUT_MS = 5000


encode = msgpack_numpy_encoder()


decode_api = msgpack_numpy_decoder(SchedulerToApiMessage)


decode_worker = msgpack_numpy_decoder(SchedulerToWorkerMessage)


class FakeWorkerThread(threading.Thread):
    """Registers, then answers every step with the fake generator; fails steps on request.
    As rank > 0 of a tensor-parallel group, it records steps and answers none."""

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        fail_request_ids=(),
        die_after_steps=None,
        rank: int = 0,
        tensor_parallel_size: int = 1,
        group: str = "",
    ) -> None:
        super().__init__(daemon=True)
        self.die_after_steps = die_after_steps
        self.rank, self.tensor_parallel_size = rank, tensor_parallel_size
        self.group = group
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.generator = FakeTokenGenerator(block_size=4)
        self.fail_request_ids = set(fail_request_ids)
        self.got_shutdown = threading.Event()
        self.steps: list[ScheduledStep] = []
        self.step_delay_s = 0.0
        """How long each step takes (settable while it runs)."""

    def run(self) -> None:
        try:
            self._serve()
        finally:
            self.socket.close()  # by its own thread, before the fixture destroys the context

    def _serve(self) -> None:
        ready = WorkerReady(
            PROTOCOL_VERSION,
            "fake",
            64,
            4,
            256,
            self.rank,
            self.tensor_parallel_size,
            group=self.group,
        )
        self.socket.send(encode(ready))
        while self.socket.poll(TIMEOUT_MS):
            message = decode_worker(self.socket.recv())
            if isinstance(message, Shutdown):
                self.got_shutdown.set()
                return
            self.steps.append(message)
            if len(self.steps) == self.die_after_steps:
                return  # closes the socket mid-step, as a killed process would
            if self.rank > 0:
                continue
            time.sleep(self.step_delay_s)
            if self.fail_request_ids & set(message.num_scheduled_tokens):
                self.socket.send(encode(WorkerFailure(message.step_id, "out of memory")))
                continue
            outputs = self.generator.next_token(message)
            self.socket.send(encode(WorkerOutput(message.step_id, outputs)))


def api_client(context, address):
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


def receive(socket):
    assert socket.poll(TIMEOUT_MS), "no reply from the scheduler"
    return decode_api(socket.recv())


def collect(socket, request_ids):
    """Read results until every request in ``request_ids`` has stopped streaming."""
    tokens = {rid: [] for rid in request_ids}
    finals = {}
    while len(finals) < len(request_ids):
        message = receive(socket)
        assert isinstance(message, SchedulerResults)
        for rid, result in message.results.items():
            if result.result is not None:
                tokens[rid] += result.result.tokens
            if result.stop_stream:
                finals[rid] = result
    return tokens, finals


def stats(client):
    """The scheduler's stats, skipping results of steps that were in flight."""
    client.send(encode(StatsRequest()))
    message = receive(client)
    while isinstance(message, SchedulerResults):
        message = receive(client)
    return message


def start_worker(context, backend, client, **options) -> FakeWorkerThread:
    """A fake worker, once the scheduler has registered it (stats say workers_ready)."""
    worker = FakeWorkerThread(context, backend, **options)
    worker.start()
    for _ in range(100):
        if stats(client).workers_ready:
            return worker
        time.sleep(0.02)
    raise AssertionError("the fake worker did not register")


def ctx(request_id, prompt, max_new_tokens=5):
    return TextContext(request_id, prompt, len(prompt) + max_new_tokens, eos_token_ids=[-1])


def expected(prompt, count):
    token_ids = list(prompt)
    for _ in range(count):
        token_ids.append(next_token_for(token_ids))
    return token_ids[len(prompt) :]
