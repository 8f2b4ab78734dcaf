"""The API server's link to the scheduler: one ZeroMQ DEALER, one reader task, a queue per request.

Requests go out as ``SubmitRequest``; the scheduler's ``SchedulerResults`` come back on the same
socket and the reader task puts each ``SchedulerResult`` on its request's queue. Every wait is
bounded: a submit the socket does not take within ``submit_timeout_s`` fails, a stats round trip
fails after ``stats_timeout_s``, and while requests are in flight the scheduler is pinged; when it
stays silent for ``scheduler_timeout_s`` every in-flight request fails with
``SchedulerUnavailable`` instead of hanging. Silence is counted only while this server could
listen: a stall of its event loop (or of the whole process) is not the scheduler's silence,
even when it outlasts the timeout and the scheduler's answers wait unread behind it.

A scheduler that dies is noticed sooner: the socket's monitor reports the dropped connection,
and new embedding requests fail at once until the connection is back. What is in flight then
is ``SchedulerReturn``'s (``api_server.resubmission``): text requests wait for the scheduler and
are submitted again with the tokens they already received, new ones wait for it too; the rest
fail with ``SchedulerUnavailable``.

``ApiHello``, the protocol version this server speaks (``interfaces.handshake``), is the first
frame sent on the first connection, and is sent again each time the monitor reports the
connection back, ahead of any request submitted on it (none is submitted while it is lost:
embeddings are refused, text requests wait).
Frames asked for while the connection was down (an abort, a stats request, embeddings still
waiting for the socket) wait in pyzmq's queue and may leave ahead of that ``ApiHello``: harmless,
since the scheduler serves frames that come before one, and refuses a server of another version
when its ``ApiHello`` arrives. A scheduler of another version answers ``HandshakeRefused``: the
reason is logged, every request fails as with a lost scheduler, and ``refused()`` returns it,
for the server to exit.

One request can never hurt the others on this connection: a frame larger than the scheduler
takes (``MAX_API_MESSAGE_BYTES``; ZeroMQ would drop the whole connection) is refused with a 413
before it is sent, and a request whose results pile up because its client stopped reading (more
than ``max_stream_backlog`` waiting) is aborted and ends with ``StreamBacklogFull``, without
the reader task ever waiting for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from api_server.config import EngineClientConfig
from api_server.errors import OpenAIError
from api_server.image_segments import ImageSegments
from api_server.resubmission import Resubmissions, SchedulerReturn
from api_server.stats_tickets import StatsTickets, StatsWaiter
from interfaces import RequestID, SchedulerResult, TextContext, TextGenerationOutput
from interfaces.api_to_scheduler import (
    MAX_API_MESSAGE_BYTES,
    AbortRequests,
    LoRAOperationRequest,
    StatsRequest,
    SubmitEmbeddings,
    SubmitRequest,
)
from interfaces.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.embeddings import EmbeddingsContext, EmbeddingsOutput
from interfaces.handshake import ApiHello, HandshakeRefused
from interfaces.lora import (
    MAX_LORAS,
    LoRAAdapterInfo,
    LoRAOperation,
    LoRARequest,
    LoRAResponse,
)
from interfaces.scheduler_to_api import (
    LoRAOperationResult,
    SchedulerStats,
    SchedulerToApiMessage,
)
from interfaces.transport import FRONTEND

logger = logging.getLogger(__name__)

Result = SchedulerResult[TextGenerationOutput]
EmbeddingsResult = SchedulerResult[EmbeddingsOutput]


class SchedulerUnavailable(Exception):
    """The scheduler did not take a message, or went silent while requests were waiting."""


class MessageTooLarge(OpenAIError):
    """413: the request's frame to the scheduler would exceed ``MAX_API_MESSAGE_BYTES``."""

    def __init__(self, num_bytes: int) -> None:
        super().__init__(
            413,
            f"The request takes {num_bytes} bytes on its way to the scheduler, more than the "
            f"limit of {MAX_API_MESSAGE_BYTES} bytes; send a smaller prompt, schema or stop list",
            "invalid_request_error",
            code="request_too_large",
        )


class StreamBacklogFull(OpenAIError):
    """The client stopped reading: more results waited for it than ``max_stream_backlog``, so
    the request was aborted (a 400 if it comes before the response starts)."""

    def __init__(self, max_stream_backlog: int) -> None:
        super().__init__(
            400,
            f"The client stopped reading the response: more than {max_stream_backlog} results "
            "were waiting for it (--max-stream-backlog), so the request was aborted",
            "invalid_request_error",
            code="stream_backlog_full",
        )


class EngineClient:
    """Submits requests to the scheduler and streams their results back.

    Create it, then ``await start()`` inside the event loop that will use it (the socket belongs
    to that loop); ``await close()`` at shutdown. Frames go out as a single msgpack frame and
    come in as ``SchedulerToApiMessage`` (the last frame of a multipart message).
    """

    def __init__(self, config: EngineClientConfig) -> None:
        self.config = config
        self._encode = msgpack_numpy_encoder()
        self._decode = msgpack_numpy_decoder(SchedulerToApiMessage)
        self._zmq_context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue[Result | Exception]] = {}
        self._stats_waiters: list[StatsWaiter] = []
        self._lora_waiters: dict[int, asyncio.Future[LoRAResponse]] = {}
        self._lora_tickets = itertools.count(1)
        self.lora_adapters: list[LoRAAdapterInfo] = []
        """The LoRA adapters of the scheduler's last stats reply (or this server's own loads
        and unloads since)."""
        self.lora_names: frozenset[str] = frozenset()
        self.max_loras: int | None = None
        """The adapters the worker groups hold at once, from the last stats reply (0: LoRA is
        not enabled; None: no reply yet)."""
        self._stats_tickets = StatsTickets(lost_after_s=config.stats_timeout_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = time.monotonic()
        self._pending_ping: asyncio.Future[Any] | None = None
        self._lost_connection: str | None = None
        """Why the scheduler is unreachable, from the moment its connection drops until it is
        back; None while connected (and before the first connection, which IMMEDIATE covers)."""
        self._refusal: asyncio.Future[str] | None = None
        """Done, with the reason, once the scheduler refused this server's ``ApiHello``."""
        self._resubmissions = Resubmissions()
        self._scheduler_return = SchedulerReturn(
            self._resubmissions,
            config.scheduler_return_timeout_s,
            has_worker_serving=self._has_worker_serving,
            submit_again=self._resubmit,
            fail=lambda request_ids, reason: self._fail(request_ids, SchedulerUnavailable(reason)),
        )

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._queues)

    @property
    def lost_connection(self) -> str | None:
        """Why the scheduler cannot be reached, or None when the connection is up."""
        return self._lost_connection

    async def start(self) -> None:
        """Connect to the scheduler and start the reader and heartbeat tasks."""
        self._zmq_context = zmq.asyncio.Context()
        self._socket = self._zmq_context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Queue messages only on a live connection, so a missing scheduler shows up as a send
        # that does not complete (and times out) rather than a request that never answers.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # a result is never dropped for being queued
        monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.config.security.connect(self._socket, self.config.scheduler_addr, FRONTEND)
        self._refusal = asyncio.get_running_loop().create_future()
        self._send_nowait(ApiHello())  # the first frame: pyzmq sends in the order asked
        self._last_heard = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._watch_connection(monitor)),
        ]

    async def refused(self) -> str:
        """Wait until the scheduler refuses this server's protocol version; the reason. Call it
        after ``start``."""
        if self._refusal is None:
            raise RuntimeError("the engine client was not started")
        return await asyncio.shield(self._refusal)

    async def close(self) -> None:
        """Stop the tasks, fail whatever is in flight, and close the socket."""
        for task in self._tasks:
            task.cancel()
        tasks = [*self._tasks, *self._scheduler_return.cancel()]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._fail_all(SchedulerUnavailable("the API server is shutting down"))
        if self._zmq_context is not None:
            self._zmq_context.destroy(linger=0)
        self._socket = self._zmq_context = None

    async def generate(
        self, context: TextContext, images: ImageSegments | None = None
    ) -> AsyncIterator[Result]:
        """Submit ``context`` and yield its results until one ends the stream.

        While the scheduler is away (the connection dropped), it first waits for the scheduler
        to come back with a worker serving (``SchedulerReturn.wait_until_served``).

        Raises ``SchedulerUnavailable`` when the submit or the scheduler times out, or the
        scheduler does not come back with a worker within ``scheduler_return_timeout_s`` (or
        the server stops waiting for it). If the
        consumer stops early (stop string, client gone, cancellation), the request is aborted
        so the scheduler frees its KV blocks.

        Once pyzmq completes ``sent``, the send of the SubmitRequest frame (``_was_sent``), the
        owner of ``context.images``' segments, ``images``, hands them over to the scheduler,
        which unlinks them when the request ends, however it ends. If this ends without sending
        (a duplicate id, no connection, a frame too large, a submit timeout, cancellation), it
        withdraws the frame from pyzmq's queue, so that it never leaves.

        Raises ``MessageTooLarge`` (413) before sending a frame above ``MAX_API_MESSAGE_BYTES``, and
        ``StreamBacklogFull`` once the request was aborted for results its consumer left
        unread.
        """
        request_id = context.request_id
        if self._scheduler_return.is_waiting:  # it left: wait for its return, as those in flight
            why = await self._scheduler_return.wait_until_served()
            if why is not None:
                raise SchedulerUnavailable(why)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if self._lost_connection is not None:
            raise SchedulerUnavailable(self._lost_connection)
        queue: asyncio.Queue[Result | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        sent: asyncio.Future[Any] | None = None
        finished = False
        try:
            frame = self._encode_bounded(SubmitRequest(context))
            self._resubmissions.submitting(context)
            sent = self._socket_or_raise().send(frame)
            await self._wait_until_sent(sent, self.config.submit_timeout_s)
            self._resubmissions.submitted(request_id)
            while not finished:
                item = await queue.get()
                if isinstance(item, StreamBacklogFull):
                    finished = True  # already aborted
                if isinstance(item, Exception):
                    raise item
                finished = item.stop_stream
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._resubmissions.forget(request_id)
            if _was_sent(sent):
                if images is not None:
                    images.hand_over()
                if not finished:
                    self.abort([request_id])
            elif sent is not None:
                sent.cancel()  # pyzmq skips a cancelled send: the frame never leaves

    async def embed(self, contexts: list[EmbeddingsContext]) -> dict[RequestID, EmbeddingsResult]:
        """Submit every input for embedding; each one's result, by id. Raises
        ``SchedulerUnavailable`` like ``generate``; if cancelled, the inputs are aborted."""
        request_ids = [context.request_id for context in contexts]
        if any(request_id in self._queues for request_id in request_ids):
            raise ValueError("an embedding input's id is already in flight")
        if self._lost_connection is not None:
            raise SchedulerUnavailable(self._lost_connection)
        queues: dict[RequestID, asyncio.Queue] = {
            request_id: asyncio.Queue() for request_id in request_ids
        }
        self._queues.update(queues)
        results: dict[RequestID, EmbeddingsResult] = {}
        try:
            await self._send(SubmitEmbeddings(contexts), self.config.submit_timeout_s)
            for request_id, queue in queues.items():
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                results[request_id] = item
            return results
        finally:
            for request_id in request_ids:
                self._queues.pop(request_id, None)
            unfinished = [request_id for request_id in request_ids if request_id not in results]
            if unfinished and self._socket is not None:
                self.abort(unfinished)

    def stop_waiting(self) -> None:
        """The server is shutting down: requests no longer wait for a scheduler that goes away
        (nothing will start it again for them), and those waiting now fail, new ones too."""
        self._scheduler_return.stop_waiting(list(self._queues), self._lost_connection)

    def abort_all(self) -> int:
        """End every request in flight now, as aborted (finish reason "abort"), and tell the
        scheduler to stop them. Returns how many there were."""
        request_ids = list(self._queues)
        for request_id, queue in self._queues.items():
            queue.put_nowait(SchedulerResult.cancelled())
            self._resubmissions.forget(request_id)
        self._queues = {}
        self.abort(request_ids)
        return len(request_ids)

    def abort(self, request_ids: list[RequestID]) -> None:
        """Ask the scheduler to stop ``request_ids``. Never waits, so it is safe in a ``finally``
        of a cancelled task; the frame leaves as soon as the socket can take it."""
        if request_ids and self._socket is not None:
            self._send_nowait(AbortRequests(request_ids=list(request_ids)))

    async def stats(self, timeout_s: float | None = None) -> SchedulerStats:
        """The scheduler's ``SchedulerStats`` in reply to a request this call sends.

        If the replies cannot be paired with requests (some were lost), the newest reply that
        arrived during the call is used once the timeout (``stats_timeout_s`` by default) ends;
        with no reply at all, ``SchedulerUnavailable``.
        """
        timeout_s = self.config.stats_timeout_s if timeout_s is None else timeout_s
        ticket, sent = self._send_stats_request()
        waiter = StatsWaiter(ticket, asyncio.get_running_loop().create_future())
        self._stats_waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter.future, timeout_s)
        except asyncio.TimeoutError as error:
            sent.cancel()
            if waiter.newest_reply is not None:
                return waiter.newest_reply
            raise SchedulerUnavailable(
                f"the scheduler did not answer a stats request within {timeout_s:g} s"
            ) from error
        finally:
            self._stats_waiters.remove(waiter)

    async def lora_operation(self, request: LoRARequest, timeout_s: float) -> LoRAResponse:
        """Have the scheduler carry out ``request`` on every worker group; its answer.
        ``SchedulerUnavailable`` if it cannot be sent or no answer comes within ``timeout_s``
        (the operation may still complete)."""
        ticket = next(self._lora_tickets)
        answer: asyncio.Future[LoRAResponse] = asyncio.get_running_loop().create_future()
        self._lora_waiters[ticket] = answer
        try:
            await self._send(LoRAOperationRequest(ticket, request), self.config.submit_timeout_s)
            response = await asyncio.wait_for(answer, timeout_s)
        except asyncio.TimeoutError as error:
            raise SchedulerUnavailable(
                f"the scheduler did not answer the LoRA {request.operation.value} within "
                f"{timeout_s:g} s"
            ) from error
        finally:
            self._lora_waiters.pop(ticket, None)
        if response.ok:
            adapters = [a for a in self.lora_adapters if a.name != request.lora_name]
            if request.operation is LoRAOperation.LOAD:
                adapters.append(LoRAAdapterInfo(request.lora_name, request.lora_path or ""))
            self._set_lora_adapters(adapters)
        return response

    def _set_lora_adapters(self, adapters: list[LoRAAdapterInfo]) -> None:
        self.lora_adapters = adapters
        self.lora_names = frozenset(adapter.name for adapter in adapters)

    def _send_stats_request(self) -> tuple[int, asyncio.Future[Any]]:
        sent = self._send_nowait(StatsRequest())
        return self._stats_tickets.sent(), sent

    async def _send(self, message: Any, timeout_s: float) -> None:
        frame = self._encode_bounded(message)
        await self._wait_until_sent(self._socket_or_raise().send(frame), timeout_s)

    def _encode_bounded(self, message: Any) -> bytes:
        """``message`` as one frame; ``MessageTooLarge`` if the scheduler would not take it."""
        frame = self._encode(message)
        if len(frame) > MAX_API_MESSAGE_BYTES:
            raise MessageTooLarge(len(frame))
        return frame

    async def _wait_until_sent(self, sent: asyncio.Future[Any], timeout_s: float) -> None:
        """Wait for a pyzmq send; on a timeout it is cancelled (never sent) and
        ``SchedulerUnavailable`` raised."""
        try:
            await asyncio.wait_for(sent, timeout_s)
        except asyncio.TimeoutError as error:
            raise SchedulerUnavailable(
                f"the scheduler at {self.config.scheduler_addr} did not accept the request "
                f"within {timeout_s:g} s"
            ) from error

    def _send_nowait(self, message: Any) -> asyncio.Future[Any]:
        future = self._socket_or_raise().send(self._encode(message))
        future.add_done_callback(_log_send_failure)
        return future

    def _socket_or_raise(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            raise SchedulerUnavailable("the API server is not connected to the scheduler")
        return self._socket

    async def _read_loop(self) -> None:
        socket = self._socket_or_raise()
        while True:
            try:
                frames = await socket.recv_multipart()
            except zmq.ZMQError as error:
                logger.error("the scheduler socket failed; no more results will arrive: %s", error)
                return
            try:
                message = self._decode(frames[-1])
            except msgspec.DecodeError as error:
                logger.warning(
                    "dropping a frame from the scheduler that does not decode: %s", error
                )
                continue
            self._last_heard = time.monotonic()
            self._dispatch(message)
            # Let consumers take what arrived before the next message, so that results piled up
            # while the loop was busy do not count as a backlog their clients left unread.
            await asyncio.sleep(0)

    def _dispatch(self, message: SchedulerToApiMessage) -> None:
        if isinstance(message, HandshakeRefused):
            self._refuse(message.reason)
            return
        if isinstance(message, LoRAOperationResult):
            answer = self._lora_waiters.get(message.ticket)
            if answer is not None and not answer.done():
                answer.set_result(message.response)
            return
        if isinstance(message, SchedulerStats):
            self._set_lora_adapters(message.lora_adapters[:MAX_LORAS])
            self.max_loras = message.max_loras
            answered = self._stats_tickets.answered()
            for waiter in self._stats_waiters:
                if waiter.ticket <= answered and not waiter.future.done():
                    waiter.future.set_result(message)
                waiter.newest_reply = message
            return
        for request_id, result in message.results.items():
            queue = self._queues.get(request_id)
            if queue is None:
                logger.debug("dropping a result for request %s, which is not in flight", request_id)
            elif queue.qsize() >= self.config.max_stream_backlog:
                self._abort_unread(request_id, queue)
            else:
                self._resubmissions.received(request_id, result)
                queue.put_nowait(result)

    def _refuse(self, reason: str) -> None:
        """The scheduler will not talk to this server: fail everything, now and from now on."""
        logger.error("the scheduler refused this API server: %s", reason)
        self._lost_connection = f"the scheduler refused this API server: {reason}"
        self._fail_all(SchedulerUnavailable(self._lost_connection))
        self._scheduler_return.refused(self._lost_connection)
        if self._refusal is not None and not self._refusal.done():
            self._refusal.set_result(reason)

    def _abort_unread(self, request_id: RequestID, queue: asyncio.Queue) -> None:
        """Abort a request whose consumer left ``max_stream_backlog`` results unread: drop them,
        and leave it ``StreamBacklogFull`` to find when it reads again."""
        logger.warning(
            "aborting request %s: its client left %d results unread",
            request_id,
            queue.qsize(),
        )
        del self._queues[request_id]
        self._resubmissions.forget(request_id)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(StreamBacklogFull(self.config.max_stream_backlog))
        self.abort([request_id])

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            asleep_since = time.monotonic()
            await asyncio.sleep(interval)
            now = time.monotonic()
            stalled = now - asleep_since - interval
            if stalled > interval:
                # The event loop (or the whole process) could not run for ``stalled`` s, so
                # nothing could be read: that time is not the scheduler's silence. What it
                # sent meanwhile waits unread; judge on the next tick, once the reader has run.
                self._last_heard = min(now, self._last_heard + stalled)
                continue
            if not self._queues:
                self._last_heard = now  # silence only counts while someone is waiting
                continue
            if self._lost_connection is not None:
                self._scheduler_return.fail_if_not_back(now, list(self._queues))
                continue
            silence = now - self._last_heard
            if silence > self.config.scheduler_timeout_s:
                self._fail_all(
                    SchedulerUnavailable(f"the scheduler has not answered for {silence:.0f} s")
                )
            elif silence >= interval and (self._pending_ping is None or self._pending_ping.done()):
                _, self._pending_ping = self._send_stats_request()

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """Track the connection to the scheduler; when it drops, fail everything in flight."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if self._refusal is not None and self._refusal.done():
                    continue  # refused: the connection stays lost
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if self._lost_connection is not None:
                        logger.info("connected to the scheduler again")
                        self._send_nowait(ApiHello())  # before any request on this connection
                        self._scheduler_return.back()
                    self._lost_connection = None
                    self._last_heard = time.monotonic()
                elif self._lost_connection is None:
                    self._on_connection_lost()
        finally:
            monitor.close(linger=0)

    def _on_connection_lost(self) -> None:
        """Fail what cannot wait for the scheduler's return; text requests wait for it."""
        if self._pending_ping is not None:
            self._pending_ping.cancel()  # never sent ahead of the next ApiHello
        self._lost_connection = (
            f"lost the connection to the scheduler at {self.config.scheduler_addr}"
        )
        self._scheduler_return.lost(list(self._queues), self._lost_connection)

    async def _has_worker_serving(self) -> bool:
        """Whether the scheduler answers a stats request with a worker ready."""
        try:
            return (await self.stats()).workers_ready
        except SchedulerUnavailable:
            return False

    def _resubmit(self, context: TextContext) -> None:
        """Send ``context`` again; one whose tokens made its frame too large fails alone."""
        try:
            frame = self._encode_bounded(SubmitRequest(context))
        except MessageTooLarge as error:
            self._fail([context.request_id], error)
            return
        self._socket_or_raise().send(frame).add_done_callback(_log_send_failure)

    def _fail_all(self, error: SchedulerUnavailable) -> None:
        self._fail(list(self._queues), error)

    def _fail(self, request_ids: list[RequestID], error: Exception) -> None:
        """End ``request_ids`` (in flight) with ``error``."""
        for request_id in request_ids:
            self._resubmissions.forget(request_id)
            queue = self._queues.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(error)
        if request_ids:
            logger.error("failing %d requests in flight: %s", len(request_ids), error)


def _was_sent(sent: asyncio.Future[Any] | None) -> bool:
    """Whether a pyzmq send completed, i.e. the frame was handed to ZeroMQ (pyzmq sends and
    completes the future in one step, and never sends a cancelled one)."""
    return sent is not None and sent.done() and not sent.cancelled() and sent.exception() is None


def _log_send_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("could not send to the scheduler: %s", future.exception())
