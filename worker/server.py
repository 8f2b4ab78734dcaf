"""The worker's ZeroMQ loop: receive a step from the scheduler, run it, send the tokens back.

The worker connects a DEALER to the scheduler's backend ROUTER, announces itself with
``WorkerReady``, then answers every ``SchedulerOutput`` with ``ModelOutput`` (or
``WorkerFailure`` if the step raised) until ``Shutdown``, SIGTERM or SIGINT. It polls with a short
timeout so signals are noticed between steps; a step in progress always finishes first.

If the connection to the scheduler drops (the scheduler died, or over TCP went silent past
ZeroMQ's heartbeat timeout), the worker exits with code 1 at once: its requests and KV cache
belong to that scheduler, and a fresh worker is what a restarted scheduler needs.

Each rank of a tensor-parallel group has its own connection and receives every step; only rank
0 answers. A rank whose collectives fail (``GroupBroken``: a peer died) exits with code 1, and
the scheduler stops the rest of the group.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from interfaces import msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.scheduler_to_worker import SchedulerOutput, SchedulerToWorkerMessage, Shutdown
from interfaces.transport import TransportSecurity
from interfaces.worker_to_scheduler import (
    ModelOutput,
    WorkerFailure,
    WorkerReady,
    WorkerToSchedulerMessage,
)
from worker.parallel import GroupBroken, tensor_parallel

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100
LINGER_MS = 1000


class WorkerServer:
    """Serves one ModelRunner to the scheduler at ``scheduler_addr`` (e.g. ``ipc:///tmp/b.ipc``).

    Owns its ZeroMQ context and socket; ``serve`` returns the process exit code.
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler_addr: str,
        security: TransportSecurity | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler_addr = scheduler_addr
        self.security = security or TransportSecurity()
        self.stop_requested = False
        self.encode = msgpack_numpy_encoder()
        self.decode = msgpack_numpy_decoder(SchedulerToWorkerMessage)

    def serve(self) -> int:
        """Run until Shutdown (exit code 0) or SIGTERM/SIGINT (also 0, after the current step)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.security.connect(socket, self.scheduler_addr)
        try:
            self._send(socket, self._ready())
            logger.info("worker ready; serving the scheduler at %s", self.scheduler_addr)
            return self._loop(socket, monitor)
        finally:
            monitor.close(linger=0)
            socket.close(linger=LINGER_MS)
            context.term()

    def _loop(self, socket: zmq.Socket, monitor: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self.stop_requested:
            events = dict(poller.poll(POLL_INTERVAL_MS))
            if socket in events:  # before the monitor: a Shutdown may precede the disconnect
                message = self._receive(socket)
                if isinstance(message, Shutdown):
                    logger.info("shutdown requested by the scheduler")
                    return 0
                if isinstance(message, SchedulerOutput):
                    try:
                        answer = self.run_step(message)
                    except GroupBroken:
                        logger.exception(
                            "left the tensor-parallel group in step %d", message.step_id
                        )
                        return 1
                    if tensor_parallel().is_driver:
                        self._send(socket, answer)
            elif monitor in events:
                endpoint = recv_monitor_message(monitor)["endpoint"].decode()
                logger.error("lost the connection to the scheduler at %s; exiting", endpoint)
                return 1
        logger.info("stopping on signal")
        return 0

    def run_step(self, step: SchedulerOutput) -> ModelOutput | WorkerFailure:
        """Run one step; a step that raises becomes a WorkerFailure and the worker serves on,
        unless its group broke (``GroupBroken`` propagates)."""
        try:
            outputs = self.runner.next_token(step)
            return ModelOutput(step.step_id, outputs, self.runner.take_refusals())
        except GroupBroken:
            raise
        except Exception as error:
            logger.exception("step %d failed", step.step_id)
            return WorkerFailure(step.step_id, str(error) or type(error).__name__)

    def _receive(self, socket: zmq.Socket) -> SchedulerToWorkerMessage | None:
        """The next message, or None (logged) for a frame that is not one."""
        frames = socket.recv_multipart()
        if len(frames) != 1:
            logger.warning("dropped a message of %d frames; expected 1", len(frames))
            return None
        try:
            return self.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            logger.warning("dropped an undecodable frame of %d bytes: %s", len(frames[0]), error)
            return None

    def _ready(self) -> WorkerReady:
        runner, group = self.runner, tensor_parallel()
        return WorkerReady(
            runner.model_name,
            runner.num_kv_blocks,
            runner.block_size,
            runner.max_model_len,
            group.rank,
            group.world_size,
        )

    def _send(self, socket: zmq.Socket, message: WorkerToSchedulerMessage) -> None:
        socket.send(self.encode(message))

    def _request_stop(self, signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        self.stop_requested = True
