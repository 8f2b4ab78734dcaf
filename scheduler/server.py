"""The scheduler process's event loop: API servers on one ROUTER, the workers on another.

One thread, one loop: drain API-server messages, collect worker outputs, and whenever a worker
group is idle and has work, schedule its next step and send it (each group has at most one step
in flight; where requests run is the call of a ``scheduler.placement.Placement``). Results go
back to the API server that owns each request, identified by its ZeroMQ identity. A
tensor-parallel group's ranks each receive every step; rank 0 answers
(``scheduler.worker_group``).

Peers that go away are noticed at once (``scheduler.peers.PeerTracker``). A worker (any rank)
that disconnects fails every request its group held with an UNAVAILABLE error (or, with hybrid
groups, moves them to another group: ``HybridPlacement.remove_group``), and the rest of the
group is told to shut down; while no group can serve, new requests are refused the same way.
A group that hangs instead is fenced once its step has run past its stall bound
(``scheduler.stalls``): it stops serving at once (its late answers are dropped), its ranks are
told to shut down and may not register again on the same connections, and its requests move
or fail as a dead group's (``Placement.remove_group`` with the cause ``WORKER_STALLED``).
An API server that disconnects has its requests aborted and their blocks freed. Nothing is
dropped for being queued: the high-water marks are off, so results wait for a busy API server
instead of vanishing; a peer that dies takes its queue with it.

Nothing that arrives is trusted beyond its types: a request's values are checked against the
served model (``scheduler.admission.context_problem``) and a bad one is refused to its sender
alone; a worker's handshake is checked (``scheduler.worker_group.ready_problem``) and a place in
a group belongs to the connection that took it; an API server may abort only the requests it
submitted. A worker or an API server of another protocol version is refused at its handshake,
and a frame that does not decode is dropped or refused (``scheduler.handshakes``). A message
whose handling raises is logged and refused, and the loop serves on; so does a departure or a
piece of the loop's own work that raises (``_guarded``): logged with its traceback each time,
and tried again where it recurs, so a broken state shows in the logs rather than ending the
process that serves every request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from interfaces import (
    ErrorKind,
    RequestID,
    SchedulerResult,
    TextContext,
    msgpack_numpy_decoder,
    msgpack_numpy_encoder,
)
from interfaces.api_to_scheduler import (
    MAX_API_MESSAGE_BYTES,
    AbortRequests,
    ApiToSchedulerMessage,
    LoRAOperationRequest,
    StatsRequest,
    SubmitEmbeddings,
    SubmitRequest,
)
from interfaces.handshake import ApiHello
from interfaces.scheduler_to_api import (
    WORKER_STALLED,
    LoRAOperationResult,
    SchedulerEmbeddingsResults,
    SchedulerResults,
    SchedulerStats,
)
from interfaces.scheduler_to_worker import EmbeddingsStep, ScheduledStep, Shutdown
from interfaces.transport import BACKEND, FRONTEND, Link, TransportSecurity
from interfaces.worker_to_scheduler import (
    GrammarsReady,
    KVReceived,
    LoRAUpdated,
    WorkerEmbeddingsOutput,
    WorkerFailure,
    WorkerOutput,
    WorkerReady,
    WorkerRole,
    WorkerToSchedulerMessage,
)
from scheduler.admission import context_problem
from scheduler.admission import refusal as admission_refusal
from scheduler.config import SchedulerConfig, WorkerLimits
from scheduler.counters import SchedulerCounters
from scheduler.departures import newest_away
from scheduler.disaggregation import DisaggregatedPlacement
from scheduler.embeddings import Embeddings, EmbeddingsByClient
from scheduler.handshakes import Handshakes
from scheduler.hybrid import HybridPlacement
from scheduler.images import ImageSegments
from scheduler.lora import LoRAAdapters, Reply, Send
from scheduler.peers import PeerTracker
from scheduler.placement import NO_WORKER, Placement
from scheduler.scheduler import STEP_FAILED, ResultsByClient, TextResult
from scheduler.stalls import LOOP_PAUSE_S, Stall, StepTimes
from scheduler.worker_group import Registration, WorkerGroup, WorkerGroups, ready_problem

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100
MAX_WORKER_MESSAGE_BYTES = 256 << 20
LORA_USAGE_MAX_AGE_S = 0.25
"""How stale the adapters of running and waiting requests may be in stats, and how long a
drained adapter may wait for the walk that unloads it."""
STALLED = "the worker serving this request stalled"
"""Why a request fails when its group was fenced and it could not move."""


class SchedulerServer:
    """Owns the sockets and the ``Scheduler``; ``run()`` loops until ``stop()`` is called."""

    def __init__(
        self,
        config: SchedulerConfig,
        frontend_addr: str,
        backend_addr: str,
        security: TransportSecurity | None = None,
        worker_limits: WorkerLimits | None = None,
    ) -> None:
        """Binds both sockets; ``ValueError`` for an address ``security`` does not allow."""
        self.config = config
        self.worker_limits = worker_limits or WorkerLimits()
        self._context = zmq.Context()
        self._binder = (security or TransportSecurity()).binder(self._context)
        self._frontend = self._bind(frontend_addr, FRONTEND, MAX_API_MESSAGE_BYTES)
        self._backend = self._bind(backend_addr, BACKEND, MAX_WORKER_MESSAGE_BYTES)
        self._api_peers = PeerTracker(self._frontend)
        self._worker_peers = PeerTracker(self._backend)
        self._encode = msgpack_numpy_encoder()
        self._decode_api = msgpack_numpy_decoder(ApiToSchedulerMessage)
        self._decode_worker = msgpack_numpy_decoder(WorkerToSchedulerMessage)
        self.counters = SchedulerCounters()
        """Shared by every group's ``Scheduler``, for the life of this process, so /metrics
        counters only grow."""
        self.placement: Placement = HybridPlacement(config, self.counters)
        """Where requests run: the first group to serve picks the kind (``_serve``)."""
        self.images = ImageSegments()
        """The pixels of requests with images, unlinked when each request leaves."""
        self.embeddings = Embeddings(config, self.counters)
        """The embedding groups, apart: they run no generation and hold no KV cache."""
        self.loras = LoRAAdapters(config.lora_adapters)
        """LoRA adapters: which requests may name, and their loads on every text group."""
        self._lora_usage_seen: tuple[list[str], list[str]] = ([], [])
        self._lora_usage_at = -math.inf
        self._drained_checked_at = -math.inf
        self._workers = WorkerGroups()
        self._handshakes = Handshakes()
        """Who is refused at the handshake, and what they are told."""
        self._in_flight: dict[str, ScheduledStep] = {}
        """The step each group is running, by group name."""
        self._step_times = StepTimes(config.stall_timeout_s)
        """When each group's step in flight (text or embeddings) was sent, and how long its
        recent steps took: who is stalled."""
        self._judged_at = time.monotonic()
        """When the loop last judged the steps in flight (``_fence_stalled``)."""
        self._stopping = threading.Event()

    def _bind(self, address: str, link: Link, max_message_bytes: int) -> zmq.Socket:
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        self._binder.bind(socket, address, link)
        logger.info("listening on %s", address)
        return socket

    def stop(self) -> None:
        """Ask ``run()`` to return after its current iteration (safe from a signal handler)."""
        self._stopping.set()

    def run(self) -> None:
        poller = zmq.Poller()
        for socket in (self._frontend, self._backend, *self._monitors()):
            poller.register(socket, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(POLL_INTERVAL_MS))
                # Departures first (see scheduler.peers), then messages.
                for worker_id in self._worker_peers.disconnected():
                    self._guarded(self._on_worker_disconnect, worker_id)
                for client_id in self._api_peers.disconnected():
                    self._guarded(self._on_api_disconnect, client_id)
                if self._frontend in events:
                    self._drain(self._frontend, self._api_peers, self._on_api_message)
                if self._backend in events:
                    self._drain(self._backend, self._worker_peers, self._on_worker_message)
                self._guarded(self._fence_stalled)
                self._guarded(self._check_timeouts)
                if self.loras.draining:
                    self._guarded(self._release_drained_loras)
                self._guarded(self._send_worker_messages)
                if self.images:
                    self._guarded(self.images.release_departed, self._holds)
        finally:
            self._shutdown()

    def _guarded(self, work: Callable[..., object], *args: object) -> None:
        """Run ``work(*args)``, one piece of the loop's work; if it raises, log the error with
        its traceback and return, so the pieces after it still run and the loop serves on (as
        ``_drain`` does for one message). Nothing is undone: a piece that fails again fails
        again in the logs, each iteration, where a state it broke shows."""
        try:
            work(*args)
        except Exception:  # one failure must not end the loop that serves everyone
            logger.exception("%s raised; serving on", work.__name__)

    def _check_timeouts(self) -> None:
        """Send the failures of requests that outlived a deadline (``check_timeouts``)."""
        self._send_results(self.placement.check_timeouts())

    def _monitors(self) -> tuple[zmq.Socket, zmq.Socket]:
        return self._api_peers.monitor, self._worker_peers.monitor

    def _drain(self, socket: zmq.Socket, peers: PeerTracker, handle) -> None:
        """Handle every message waiting on ``socket`` with ``handle(identity, payload)``."""
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames; expected 2", len(frames))
                continue
            identity = frames[0].bytes
            peers.saw(identity, frames[1])
            try:
                handle(identity, frames[1].buffer)
            except Exception:  # one message must not end the loop that serves everyone
                logger.exception("could not handle a message; dropped it and serving on")

    # -- API servers ---------------------------------------------------------------------------

    def _on_api_message(self, client_id: bytes, payload: memoryview) -> None:
        if self._handshakes.refused(client_id):
            return
        try:
            message = self._decode_api(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            reply = self._handshakes.on_undecodable_api_frame(client_id, payload, error)
            self._answer_api(client_id, reply)
            return
        if isinstance(message, ApiHello):
            reply = self._handshakes.on_hello(client_id, message.protocol_version)
            self._answer_api(client_id, reply)
        elif isinstance(message, SubmitRequest):
            self._on_submit(client_id, message.context)
        elif isinstance(message, SubmitEmbeddings):
            self._send_embeddings(self.embeddings.submit(client_id, message.contexts))
        elif isinstance(message, AbortRequests):
            self._on_abort(client_id, message.request_ids)
        elif isinstance(message, StatsRequest):
            self._answer_api(client_id, self.stats())
        elif isinstance(message, LoRAOperationRequest):
            # Adapters no request uses any more free their slots first: a load right after the
            # last request of an unloaded adapter ended finds its slot free.
            self._release_drained_loras(at_once=True)
            self._carry_out_lora(*self.loras.request((client_id, message.ticket), message.request))
            self._release_drained_loras(at_once=True)  # an unload of an adapter nobody uses

    def _answer_api(self, client_id: bytes, reply: msgspec.Struct | None) -> None:
        """Send ``reply`` to API server ``client_id``; None sends nothing."""
        if reply is not None:
            self._frontend.send_multipart([client_id, self._encode(reply)])

    def _on_submit(self, client_id: bytes, context: TextContext) -> None:
        problem = context_problem(context, self.placement.vocab_size)
        result = admission_refusal(context, problem, None) if problem is not None else None
        if result is None:
            context, result = self._with_lora_id(context)
        if result is None:
            result = self._add_request(client_id, context)
        if result is not None:
            self.images.refuse(context)
            self._send_results({client_id: {context.request_id: result}})
        else:
            self.images.add(context)

    def _with_lora_id(self, context: TextContext) -> tuple[TextContext, TextResult | None]:
        """``context`` with the id of the LoRA adapter it names (or 0), or the result refusing
        it: the adapter is not loaded (never loaded, or unloaded since the API server looked)."""
        lora_id = 0
        if context.lora_name is not None:
            lora_id = self.loras.resolve(context.lora_name)
            if lora_id is None:
                error = "the LoRA adapter this request names is not loaded"
                return context, SchedulerResult.cancelled(error, ErrorKind.NOT_FOUND)
        if context.lora_id != lora_id:
            context = msgspec.structs.replace(context, lora_id=lora_id)
        return context, None

    def _add_request(self, client_id: bytes, context: TextContext) -> TextResult | None:
        """``Placement.add_request``; a request whose admission raised is dropped again and
        refused (logged), and the scheduler serves on."""
        request_id = context.request_id
        known = self.placement.owner(request_id) is not None
        try:
            return self.placement.add_request(context, client_id)
        except Exception:
            logger.exception("could not admit request %s; refused it", request_id)
            if not known:
                self.placement.abort_requests([request_id])
            error = "the scheduler could not admit this request"
            return SchedulerResult.cancelled(error, ErrorKind.INTERNAL)

    def _on_abort(self, client_id: bytes, request_ids: list[RequestID]) -> None:
        """Abort those of ``request_ids`` that API server ``client_id`` submitted; another
        server's are left alone (logged), unknown ones ignored."""
        self.embeddings.abort(client_id, request_ids)
        owners = {request_id: self.placement.owner(request_id) for request_id in request_ids}
        mine = [request_id for request_id, owner in owners.items() if owner == client_id]
        num_foreign = sum(owner not in (None, client_id) for owner in owners.values())
        if num_foreign:
            logger.warning("ignored an abort of %d requests another API server owns", num_foreign)
        if mine:
            self._send_results(self.placement.abort_requests(mine))

    def _on_api_disconnect(self, client_id: bytes) -> None:
        self._handshakes.forget(client_id)
        num_aborted = self.placement.abort_client(client_id)
        num_aborted += self.embeddings.abort_client(client_id)
        if num_aborted:
            logger.warning("an API server went away; aborted its %d requests", num_aborted)

    def _holds(self, request_id: RequestID) -> bool:
        """Whether a request is in the scheduler, or in a step a worker is still running (an
        aborted request's pixels stay until the step that may read them is answered)."""
        return self.placement.owner(request_id) is not None or any(
            request_id in step.num_scheduled_tokens for step in self._in_flight.values()
        )

    def stats(self) -> SchedulerStats:
        stats = self.placement.stats()
        stats.embedding_workers_ready = bool(self.embeddings.groups)
        stats.groups_away = newest_away(stats.groups_away, self.embeddings.groups_away())
        stats.lora_adapters = self.loras.infos()
        stats.max_loras = self.loras.max_loras
        if stats.max_loras:
            stats.running_lora_adapters, stats.waiting_lora_adapters = self._lora_usage()
        return stats

    def _lora_usage(self) -> tuple[list[str], list[str]]:
        """The adapters of running and of waiting requests: a walk over every request, made
        at most every ``LORA_USAGE_MAX_AGE_S`` however often stats are asked for."""
        now = time.monotonic()
        if now - self._lora_usage_at >= LORA_USAGE_MAX_AGE_S:
            running, waiting = set(), set()
            for context, is_running in self.placement.contexts():
                if context.lora_name is not None and context.lora_id:
                    (running if is_running else waiting).add(context.lora_name)
            self._lora_usage_at, self._lora_usage_seen = now, (sorted(running), sorted(waiting))
        return self._lora_usage_seen

    # -- LoRA adapters -------------------------------------------------------------------------

    def _carry_out_lora(self, replies: list[Reply], sends: list[Send]) -> None:
        """Answer API servers and send updates to every rank of the groups named."""
        for (client_id, ticket), response in replies:
            self._answer_api(client_id, LoRAOperationResult(ticket, response))
        now = time.monotonic()
        for names, update in sends:
            payload = self._encode(update)
            for name in names:
                group = self._workers.groups.get(name)
                if group is None:
                    continue
                self._step_times.lora_update_sent(name, now)
                for identity in group.members:
                    self._backend.send_multipart([identity, payload])

    def _release_drained_loras(self, at_once: bool = False) -> None:
        """Unload the drained adapters no request uses any more (a walk over every request,
        at most every ``LORA_USAGE_MAX_AGE_S`` unless ``at_once``)."""
        now = time.monotonic()
        if not self.loras.draining:
            return
        if not at_once and now - self._drained_checked_at < LORA_USAGE_MAX_AGE_S:
            return
        self._drained_checked_at = now
        in_use = {context.lora_id for context, _ in self.placement.contexts()}
        self._carry_out_lora([], self.loras.release_drained(in_use))

    def _send_results(self, results: ResultsByClient) -> None:
        for client_id, by_request in results.items():
            if by_request:
                message = SchedulerResults(by_request)
                self._frontend.send_multipart([client_id, self._encode(message)])

    def _send_embeddings(self, results: EmbeddingsByClient) -> None:
        for client_id, by_request in results.items():
            if by_request:
                message = SchedulerEmbeddingsResults(by_request)
                self._frontend.send_multipart([client_id, self._encode(message)])

    # -- the workers ---------------------------------------------------------------------------

    def _on_worker_message(self, worker_id: bytes, payload: memoryview) -> None:
        try:
            message = self._decode_worker(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as error:
            reply = self._handshakes.on_undecodable_worker_frame(payload, error)
            self._answer_worker(worker_id, reply)
            return
        if isinstance(message, WorkerReady):
            self._on_worker_ready(worker_id, message)
            return
        fenced = self._workers.fenced_group(worker_id)
        if fenced is not None:
            logger.warning("dropped a late %s from fenced group %r", type(message).__name__, fenced)
            return
        group = self._workers.group_of(worker_id)
        if group is not None and group.name in self.embeddings.groups:
            self._on_embedding_worker_message(group.name, worker_id == group.driver, message)
            return
        serving = group is not None and group.name in self.placement.groups
        if isinstance(message, KVReceived):
            if serving and _is_own_report(group, worker_id, message):
                self.placement.on_kv_received(group.name, message)
            elif serving:
                logger.warning("dropped a KVReceived that is not its sender's: %s", message)
            return
        if isinstance(message, GrammarsReady):
            self._on_grammars(group if serving else None, worker_id, message)
            return
        if isinstance(message, LoRAUpdated):
            if serving and worker_id == group.driver:
                self._step_times.lora_update_answered(group.name, time.monotonic())
                self._carry_out_lora(*self.loras.on_updated(group.name, message))
            else:
                logger.warning("dropped an unexpected LoRAUpdated from a worker")
            return
        step = self._in_flight.get(group.name) if serving else None
        if step is None or worker_id != group.driver:
            logger.warning("dropped an unexpected %s from a worker", type(message).__name__)
        elif message.step_id != step.step_id:
            logger.warning("dropped output of step %d, expected %d", message.step_id, step.step_id)
        elif isinstance(message, WorkerOutput):
            del self._in_flight[group.name]
            self._step_times.answered(group.name, time.monotonic())
            self._send_results(self.placement.update_from_output(group.name, message))
        elif isinstance(message, WorkerFailure):
            logger.error("group %r failed step %d: %s", group.name, message.step_id, message.error)
            del self._in_flight[group.name]  # the detail may name any request: logs only
            self._step_times.answered(group.name, time.monotonic())
            self._send_results(self.placement.fail_step(group.name, step, STEP_FAILED))

    def _on_grammars(
        self, group: WorkerGroup | None, worker_id: bytes, news: GrammarsReady
    ) -> None:
        """A serving group's driver says which parked requests may sample (or failed)."""
        if group is None or worker_id != group.driver:
            logger.warning("dropped an unexpected GrammarsReady from a worker")
            return
        self._send_results(self.placement.on_grammars(group.name, news))

    def _on_embedding_worker_message(
        self, name: str, from_driver: bool, message: WorkerToSchedulerMessage
    ) -> None:
        step_and_owners = self.embeddings.in_flight.get(name)
        answer = isinstance(message, WorkerEmbeddingsOutput | WorkerFailure)
        if step_and_owners is None or not from_driver or not answer:
            logger.warning("dropped an unexpected %s from a worker", type(message).__name__)
        elif message.step_id != step_and_owners[0].step_id:
            logger.warning("dropped embeddings of step %d", message.step_id)
        elif isinstance(message, WorkerEmbeddingsOutput):
            self._step_times.answered(name, time.monotonic())
            self._send_embeddings(self.embeddings.on_output(name, message))
        elif isinstance(message, WorkerFailure):
            logger.error("group %r failed embedding step %d: %s", name, message.step_id,
                         message.error)  # fmt: skip
            self._step_times.answered(name, time.monotonic())
            self._send_embeddings(self.embeddings.fail_step(name, STEP_FAILED))

    def _on_worker_disconnect(self, worker_id: bytes) -> None:
        registration = self._workers.leave(worker_id)
        if registration is None:
            return
        if registration.was_serving:
            logger.error(
                "a worker of group %r disconnected; failing or moving its requests",
                registration.group,
            )
        self._retire(registration, "the worker serving this request died")

    def _answer_worker(self, worker_id: bytes, reply: Shutdown | None) -> None:
        """Send ``reply`` to worker ``worker_id``; None sends nothing."""
        if reply is not None:
            self._backend.send_multipart([worker_id, self._encode(reply)])

    def _on_worker_ready(self, worker_id: bytes, ready: WorkerReady) -> None:
        """Register a worker; one whose handshake is refused is told why and shut down, and
        nothing else changes."""
        refusal = self._handshakes.on_worker_ready(ready)
        if refusal is not None:
            self._answer_worker(worker_id, refusal)
            return
        problem = ready_problem(ready, self.worker_limits)
        if problem is not None:
            error = f"refused the handshake of a worker of group {ready.group!r}: {problem}"
            registration = Registration(ready.group, [worker_id], False, False, error)
        else:
            registration = self._workers.register(worker_id, ready)
        if registration.error is not None:
            logger.error("%s", registration.error)
            self._retire(registration, registration.error)
            return
        if registration.now_serving and ready.role is WorkerRole.EMBEDDING:
            self.embeddings.add_group(ready.group, ready.step_tokens)
            logger.info("serving embedding group %r: %s", ready.group, ready.model_name)
        elif registration.now_serving:
            group = self._workers.groups[ready.group]
            refusal = self._serve(group)
            if refusal is not None:
                logger.error("%s", refusal)
                for identity in self._workers.remove(group.name):
                    self._backend.send_multipart([identity, self._encode(Shutdown(refusal))])
        else:
            logger.info(
                "worker rank %d of %d of group %r (%s) registered; waiting for the rest",
                ready.rank,
                ready.tensor_parallel_size,
                ready.group,
                ready.role.value,
            )

    def _serve(self, group: WorkerGroup) -> str | None:
        """``Placement.add_group``; the first group to serve picks how requests are placed."""
        if not self.placement.groups and group.role not in self.placement.roles:
            kind = HybridPlacement if group.role is WorkerRole.HYBRID else DisaggregatedPlacement
            # Requests that waited for a group of the old kind (HybridPlacement.stranded) fail.
            self._send_results(self.placement.fail_all(NO_WORKER))
            self.placement = kind(self.config, self.counters)
        refusal = self.placement.add_group(group)
        if refusal is None:
            self._carry_out_lora(*self.loras.group_joined(group.name, group.ready.max_loras))
        return refusal

    def _retire(self, registration: Registration, reason: str) -> None:
        """Fail the requests of a group that stopped serving, and shut down its survivors (a
        refused registration is told why)."""
        if registration.was_serving:
            self._step_times.forget(registration.group)
        if registration.was_serving and registration.group in self.embeddings.groups:
            self._send_embeddings(self.embeddings.remove_group(registration.group, reason))
        elif registration.was_serving:
            self._in_flight.pop(registration.group, None)
            self._send_results(self.placement.remove_group(registration.group, reason))
            self._carry_out_lora(*self.loras.group_left(registration.group))
        shutdown = Shutdown(registration.error) if registration.error else Shutdown()
        for identity in registration.retired:
            self._backend.send_multipart([identity, self._encode(shutdown)])

    def _fence_stalled(self) -> None:
        """Fence every group whose step has run past its stall bound (``scheduler.stalls``);
        one whose fencing raises does not keep the others from being fenced. A pass of the
        loop longer than ``LOOP_PAUSE_S`` was the scheduler's own stall: the time past it is
        credited to the steps in flight first, whose answers may wait unread."""
        now = time.monotonic()
        paused_s = now - self._judged_at - LOOP_PAUSE_S
        self._judged_at = now
        if paused_s > 0:
            logger.warning(
                "the scheduler's loop stalled for %.1f s; its workers' steps in flight are "
                "not judged for that time",
                paused_s + LOOP_PAUSE_S,
            )
            self._step_times.paused(paused_s)
        for stall in self._step_times.stalled(now):
            self._guarded(self._fence, stall)

    def _fence(self, stall: Stall) -> None:
        """Group ``stall.group`` stops serving at once: it is no longer registered, so its late
        answers are dropped; its requests move or fail as a dead group's (an embedding group's
        inputs run again elsewhere, once); each rank is told why in a ``Shutdown``, and its
        connection may not register again (a new connection under the group's name may)."""
        name, why = stall.group, stall.describe()
        logger.error("%s; fenced it: its requests move to another group or fail", why)
        self._step_times.forget(name)
        members = self._workers.fence(name)
        if name in self.embeddings.groups:
            self._send_embeddings(self.embeddings.remove_group(name, STALLED, WORKER_STALLED))
        else:
            self._in_flight.pop(name, None)
            self._send_results(self.placement.remove_group(name, STALLED, cause=WORKER_STALLED))
            self._carry_out_lora(*self.loras.group_left(name))
        shutdown = self._encode(Shutdown(why))
        for identity in members:
            self._backend.send_multipart([identity, shutdown])

    def _send_worker_messages(self) -> None:
        """Send the placement's news and the next step of every idle group."""
        embedding_steps = self.embeddings.schedule(self.embeddings.groups)
        idle = [name for name in self.placement.groups if name not in self._in_flight]
        for name, message in [*embedding_steps, *self.placement.schedule(idle)]:
            group = self._workers.groups.get(name)
            if group is None:
                continue  # it left while the message waited
            if isinstance(message, ScheduledStep):
                self._in_flight[name] = message
            if isinstance(message, ScheduledStep | EmbeddingsStep):
                self._step_times.sent(name, message.step_id, time.monotonic())
            payload = self._encode(message)
            for identity in group.members:
                self._backend.send_multipart([identity, payload])

    def _shutdown(self) -> None:
        self._send_results(self.placement.fail_all("the scheduler is shutting down"))
        self.images.release_all()
        for name in list(self.embeddings.groups):
            self._send_embeddings(
                self.embeddings.remove_group(name, "the scheduler is shutting down")
            )
        for group in self._workers.groups.values():
            for identity in group.members:
                self._backend.send_multipart([identity, self._encode(Shutdown())])
        self._api_peers.close()
        self._worker_peers.close()
        self._frontend.close()
        self._backend.close()
        self._binder.close()
        self._context.term()


def _is_own_report(group: WorkerGroup, worker_id: bytes, report: KVReceived) -> bool:
    """Whether ``report`` comes from the rank it names, and its numbers are ones."""
    return (
        group.identities.get(report.rank) == worker_id
        and report.num_bytes >= 0
        and math.isfinite(report.seconds)
        and report.seconds >= 0
    )
