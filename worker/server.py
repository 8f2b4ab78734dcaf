"""The worker's ZeroMQ loop: receive a step from the scheduler, run it, send the tokens back.

The worker connects a DEALER to the scheduler's backend ROUTER, announces itself with
``WorkerReady`` (its protocol version first), then answers every ``ScheduledStep`` with
``WorkerOutput`` (or ``WorkerFailure`` if the step raised) until ``Shutdown``, SIGTERM or SIGINT.
A ``Shutdown`` with a reason is a refusal (another protocol version, a handshake the scheduler
does not believe): the worker logs the reason and exits 1. It polls with a short
timeout so signals are noticed between steps; a step in progress always finishes first. Rank 0
also polls the pipe its grammar compiles write to, and sends ``GrammarsReady`` between steps
when a deferred request's grammar compiled or failed (``worker.model_runner``). A ``LoRAUpdate``
loads or unloads an adapter between steps on every rank (``worker.lora``); rank 0 answers
``LoRAUpdated`` once the ranks agree.

If the connection to the scheduler drops (the scheduler died, or over TCP went silent past
ZeroMQ's heartbeat timeout), a one-rank worker forgets every request it had (they were that
scheduler's; the contents of its KV cache are never read again: a new scheduler's blocks are all
free), closes the connection, dropping what it had not sent yet, and registers again on a new
one, which a scheduler restarted at the same address takes: the model is not loaded again. A
rank of a tensor-parallel group exits with code 1 instead: when the scheduler died between
sending a step to one rank and to another, the ranks' collectives are out of step, and the group
is started again whole (``switchyard serve`` does so; an orchestrator restarts its containers).

Each rank of a tensor-parallel group has its own connection and receives every step; only rank
0 answers. A rank whose collectives fail (``GroupBroken``: a peer died) exits with code 1, and
the scheduler stops the rest of the group.

With disaggregation (``worker.kv_transfer``), a prefill rank sends the KV blocks a step names in
``kv_sends`` once the step has run (after answering it, so the first token streams at once); a
decode rank also polls its transfer socket, writes arriving blocks between steps, and reports
each finished transfer with ``KVReceived``.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from interfaces import msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.handshake import PROTOCOL_VERSION
from interfaces.scheduler_to_worker import (
    EmbeddingsStep,
    KVTransfers,
    LoRAUpdate,
    ScheduledStep,
    SchedulerToWorkerMessage,
    Shutdown,
)
from interfaces.transport import BACKEND, Binder, TransportSecurity
from interfaces.worker_to_scheduler import (
    LoRAUpdated,
    WorkerEmbeddingsOutput,
    WorkerFailure,
    WorkerOutput,
    WorkerReady,
    WorkerRole,
    WorkerToSchedulerMessage,
)
from worker.kv_transfer import KVReceiver, KVSender
from worker.liveness import Heartbeat
from worker.lora import update_without_lora
from worker.parallel import GroupBroken, tensor_parallel

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100
LINGER_MS = 1000


class WorkerServer:
    """Serves one ModelRunner to the scheduler at ``scheduler_addr`` (e.g. ``ipc:///tmp/b.ipc``).

    Owns its ZeroMQ context and sockets; ``serve`` returns the process exit code. A ``decode``
    worker receives KV blocks at ``transfer_addr`` (``tcp://HOST:*`` picks a free port). With
    ``liveness_file``, its loop beats there between steps (``worker.liveness``).
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler_addr: str,
        security: TransportSecurity | None = None,
        role: WorkerRole = WorkerRole.HYBRID,
        group: str = "",
        transfer_addr: str = "tcp://127.0.0.1:*",
        liveness_file: Path | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler_addr = scheduler_addr
        self.security = security or TransportSecurity()
        self.role = role
        self.group = group or role.value
        self.transfer_addr = transfer_addr
        self.stop_requested = False
        self.encode = msgpack_numpy_encoder()
        self.decode = msgpack_numpy_decoder(SchedulerToWorkerMessage)
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.heartbeat = Heartbeat(liveness_file) if liveness_file is not None else None

    def serve(self) -> int:
        """Run until Shutdown (exit code 0) or SIGTERM/SIGINT (also 0, after the current step)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        context = zmq.Context()
        binder = self.security.binder(context)
        try:
            self._open_transfers(context, binder)
        except (ValueError, zmq.ZMQError) as error:
            logger.error("cannot receive KV transfers at %s: %s", self.transfer_addr, error)
            binder.close()
            context.term()
            return 1
        try:
            socket, monitor = self._register(context)
        except ValueError as error:  # a CURVE key file this worker needs is missing
            logger.error("cannot connect to the scheduler at %s: %s", self.scheduler_addr, error)
            self._close_transfers()
            binder.close()
            context.term()
            return 1
        try:
            while (code := self._loop(socket, monitor)) is None:
                self._forget_the_scheduler()
                monitor.close(linger=0)
                socket.close(linger=0)  # what the scheduler that went away did not receive
                socket, monitor = self._register(context)
            return code
        finally:
            monitor.close(linger=0)
            socket.close(linger=LINGER_MS)
            self._close_transfers()
            binder.close()
            context.term()

    def _register(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """A new connection to the scheduler, and its monitor; ``WorkerReady`` is queued on
        it, sent once a scheduler answers there. ``ValueError`` if a CURVE key file this
        worker needs is missing."""
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            self.security.connect(socket, self.scheduler_addr, BACKEND)
        except ValueError:
            monitor.close(linger=0)
            socket.close(linger=0)
            raise
        self._send(socket, self._ready())
        logger.info(
            "worker ready (%s, group %s); serving the scheduler at %s",
            self.role.value,
            self.group,
            self.scheduler_addr,
        )
        return socket, monitor

    def _forget_the_scheduler(self) -> None:
        """Drop the requests and KV transfers of the scheduler that went away."""
        self.runner.release_all()
        if self.receiver is not None:
            self.receiver.cancel_all()

    def _close_transfers(self) -> None:
        for transfers in (self.sender, self.receiver):
            if transfers is not None:
                transfers.close()

    def _open_transfers(self, context: zmq.Context, binder: Binder) -> None:
        runner, group = self.runner, tensor_parallel()
        if self.role is WorkerRole.PREFILL:
            self.sender = KVSender(
                context,
                self.security,
                runner.kv_cache,
                runner.kv_layout,
                group.rank,
                group.world_size,
            )
        elif self.role is WorkerRole.DECODE:
            self.receiver = KVReceiver(
                context,
                binder,
                self.transfer_addr,
                runner.kv_cache,
                runner.kv_layout,
                group.rank,
                group.world_size,
            )
            logger.info("receiving KV transfers at %s", self.receiver.address)

    def _loop(self, socket: zmq.Socket, monitor: zmq.Socket) -> int | None:
        """Serve the scheduler on ``socket`` until it ends: the exit code, or None when the
        connection dropped and this worker should register again (see the module)."""
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        if self.receiver is not None:
            poller.register(self.receiver.socket, zmq.POLLIN)
        grammar_wakeup = getattr(self.runner, "grammar_wakeup_fd", None)
        if grammar_wakeup is not None:
            poller.register(grammar_wakeup, zmq.POLLIN)
        while not self.stop_requested:
            if self.heartbeat is not None:
                self.heartbeat.beat()
            events = dict(poller.poll(POLL_INTERVAL_MS))
            if grammar_wakeup is not None:  # also on every poll timeout: compile time limits
                self._send_grammar_news(socket)
            if socket in events:  # before the monitor: a Shutdown may precede the disconnect
                message = self._receive(socket)
                if isinstance(message, Shutdown):
                    if message.reason is not None:
                        logger.error("the scheduler refused this worker: %s", message.reason)
                        return 1
                    logger.info("shutdown requested by the scheduler")
                    return 0
                if isinstance(message, ScheduledStep):
                    try:
                        self._step(socket, message)
                    except GroupBroken:
                        logger.exception(
                            "left the tensor-parallel group in step %d", message.step_id
                        )
                        return 1
                elif isinstance(message, EmbeddingsStep):
                    self._send(socket, self.run_embeddings_step(message))
                elif isinstance(message, KVTransfers):
                    self._on_transfers(socket, message)
                elif isinstance(message, LoRAUpdate):
                    try:
                        self._send_if_driver(socket, self.update_lora(message))
                    except GroupBroken:
                        logger.exception("left the tensor-parallel group in a LoRA update")
                        return 1
            elif monitor in events:
                endpoint = recv_monitor_message(monitor)["endpoint"].decode()
                if tensor_parallel().world_size > 1:
                    logger.error(
                        "lost the connection to the scheduler at %s; exiting (the ranks of a "
                        "tensor-parallel group start again together)",
                        endpoint,
                    )
                    return 1
                logger.error(
                    "lost the connection to the scheduler at %s; dropping its requests and "
                    "registering again once a scheduler answers there",
                    endpoint,
                )
                return None
            # After the scheduler's messages, which may announce what is arriving here.
            if self.receiver is not None and self.receiver.socket in events:
                for report in self.receiver.receive():
                    self._send(socket, report)
        logger.info("stopping on signal")
        return 0

    def _step(self, socket: zmq.Socket, step: ScheduledStep) -> None:
        answer = self.run_step(step)
        self._send_if_driver(socket, answer)
        if not step.kv_sends or not isinstance(answer, WorkerOutput):
            return
        if self.sender is None:
            logger.error("step %d asks a %s worker to send KV", step.step_id, self.role.value)
            return
        sends = [send for send in step.kv_sends if send.request_id not in answer.refused]
        try:
            self.sender.send(sends)
        except (RuntimeError, ValueError, zmq.ZMQError):  # the scheduler's timeout fails them
            logger.exception("could not send the KV blocks of step %d", step.step_id)

    def _send_grammar_news(self, socket: zmq.Socket) -> None:
        """Tell the scheduler which deferred requests' grammars are ready or failed."""
        news = self.runner.grammar_news()
        if news is not None:
            self._send(socket, news)

    def _on_transfers(self, socket: zmq.Socket, transfers: KVTransfers) -> None:
        if self.receiver is None:
            logger.error("dropped KV transfer news sent to a %s worker", self.role.value)
            return
        self.receiver.cancel(transfers.cancel)
        for receive in transfers.receive:
            report = self.receiver.expect(receive)
            if report is not None:
                self._send(socket, report)

    def run_embeddings_step(self, step: EmbeddingsStep) -> WorkerEmbeddingsOutput | WorkerFailure:
        """An embedding group's step; one that raises becomes a WorkerFailure."""
        if self.role is not WorkerRole.EMBEDDING:
            return WorkerFailure(step.step_id, f"a {self.role.value} worker embeds nothing")
        try:
            return self.runner.embed(step)
        except Exception as error:
            logger.exception("embedding step %d failed", step.step_id)
            return WorkerFailure(step.step_id, str(error) or type(error).__name__)

    def update_lora(self, update: LoRAUpdate) -> LoRAUpdated:
        """Load or unload a LoRA adapter (``worker.lora``); a worker that serves none (an
        embedding worker) answers that LoRA is not enabled. ``GroupBroken`` propagates."""
        update_lora = getattr(self.runner, "update_lora", None)
        if update_lora is None:
            return update_without_lora(update)
        return update_lora(update)

    def run_step(self, step: ScheduledStep) -> WorkerOutput | WorkerFailure:
        """Run one step; a step that raises becomes a WorkerFailure and the worker serves on,
        unless its group broke (``GroupBroken`` propagates). Requests that failed alone, or
        wait for their grammar, ride in the WorkerOutput."""
        runner = self.runner
        try:
            outputs = runner.next_token(step)
            return WorkerOutput(
                step.step_id,
                outputs,
                runner.take_refusals(),
                runner.take_failures(),
                runner.take_deferred(),
            )
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
            PROTOCOL_VERSION,
            runner.model_name,
            runner.num_kv_blocks,
            runner.block_size,
            runner.max_model_len,
            group.rank,
            group.world_size,
            self.role,
            self.group,
            runner.kv_layout,
            self.receiver.address if self.receiver is not None else "",
            runner.vocab_size,
            *getattr(runner, "lora_limits", (0, 0)),
            step_tokens=getattr(runner, "step_tokens", 0),
        )

    def _send_if_driver(self, socket: zmq.Socket, message: WorkerToSchedulerMessage) -> None:
        """Rank 0 answers for the group."""
        if tensor_parallel().is_driver:
            self._send(socket, message)

    def _send(self, socket: zmq.Socket, message: WorkerToSchedulerMessage) -> None:
        socket.send(self.encode(message))

    def _request_stop(self, signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        self.stop_requested = True
