"""A stand-in for the scheduler process, so API server tests need no model and no worker.

A thread owns a ZeroMQ ROUTER bound to an ``ipc://`` address. It answers ``StatsRequest`` with
``SchedulerStats``; for each ``SubmitRequest`` it streams a fixed token sequence (``reply``, then
``eos_token_id``) one step at a time, finishing with END_OF_SEQUENCE, or with MAXIMUM_LENGTH when
the context's ``max_length`` is reached first; it records every submitted context and every
aborted request id. Behaviour is set through attributes between tests (see ``reset``). It
records each ``ApiHello`` and answers it with ``HandshakeRefused`` when ``refuse_hello_with``
is set, as a scheduler of another protocol version does.

When a context asks for log probabilities the fake reports canned ones, as the worker would:
``fake_logprob(position)`` for each token and ``fake_top(token_id, position, k)`` for its
alternatives (output positions count from 0; prompt positions from 1, the first prompt token
having none), so tests can compute the exact values they expect.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from interfaces import LogProbabilities, SchedulerResult, TextContext, TextGenerationOutput
from interfaces.api_to_scheduler import (
    AbortRequests,
    ApiToSchedulerMessage,
    LoRAOperationRequest,
    StatsRequest,
    SubmitEmbeddings,
    SubmitRequest,
)
from interfaces.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.embeddings import EmbeddingsContext
from interfaces.handshake import ApiHello, HandshakeRefused
from interfaces.lora import (
    LoRAAdapterInfo,
    LoRAOperation,
    LoRARequest,
    LoRAResponse,
    LoRAStatus,
)
from interfaces.outputs import GenerationStatus
from interfaces.scheduler_to_api import LoRAOperationResult, SchedulerResults, SchedulerStats

VOCAB_SIZE = 49152


def fake_logprob(position: int) -> float:
    """The log probability the fake reports for the token at ``position``."""
    return -0.5 * (position + 1)


def fake_top(token_id: int, position: int, k: int) -> dict[int, float]:
    """The ``k`` alternatives the fake reports: the ids after ``token_id``, each less likely
    than the one before and than ``token_id`` (which is not among them)."""
    value = fake_logprob(position)
    return {(token_id + 1 + j) % VOCAB_SIZE: value - 1.0 - j for j in range(k)}


def fake_logprobs(token_ids: list[int], positions: range, k: int) -> LogProbabilities:
    return LogProbabilities(
        token_log_probabilities=[fake_logprob(position) for position in positions],
        top_log_probabilities=[
            fake_top(token_id, position, k)
            for token_id, position in zip(token_ids, positions, strict=True)
        ],
    )


@dataclass
class _Running:
    identity: bytes
    context: TextContext
    num_generated: int = 0


class FakeScheduler:
    """Serves ``address`` until ``stop()``; thread-safe for the attributes tests read and set.

    ``reply``: token ids every request generates before ``eos_token_id`` (None: no EOS).
    ``repeat``: cycle ``reply`` forever (only max_length or an abort ends the request).
    ``tokens_per_step``: tokens per result; ``step_interval_s``: time between steps.
    ``fail_with`` / ``fail_after_tokens``: cancel each request with this error after that many
    tokens (only those whose id ends with ``fail_only_ending`` unless it is None).
    ``workers_ready``: reported in stats. ``silent``: answer nothing at all.
    ``num_stats_requests`` counts the StatsRequests received (round trips and pings).
    Embedding inputs are recorded in ``embeddings_submitted`` and never answered.
    LoRA operations are recorded in ``lora_requests`` and answered ``lora_answer`` (None:
    success, which loads into or unloads from ``lora_adapters``, listed in stats with
    ``max_loras``).
    """

    def __init__(self, address: str, num_kv_blocks: int = 64, block_size: int = 16) -> None:
        self.address = address
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.submitted: list[TextContext] = []
        self.embeddings_submitted: list[EmbeddingsContext] = []
        self.aborted: list[str] = []
        self.hellos: list[ApiHello] = []
        self.num_stats_requests = 0
        self.reset()
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._encode = msgpack_numpy_encoder()
        self._decode = msgpack_numpy_decoder(ApiToSchedulerMessage)
        self._zmq_context = zmq.Context()
        self._socket = self._zmq_context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._thread = threading.Thread(target=self._serve, name="fake-scheduler", daemon=True)

    def reset(self) -> None:
        """Back to the default behaviour: reply [] + EOS, one token per fast step."""
        self.reply: list[int] = []
        self.eos_token_id: int | None = None
        self.repeat = False
        self.tokens_per_step = 1
        self.step_interval_s = 0.001
        self.fail_with: str | None = None
        self.fail_after_tokens = 0
        self.fail_only_ending: str | None = None
        self.reject_with: str | None = None
        self.refuse_hello_with: str | None = None
        self.workers_ready = True
        self.silent = False
        self.max_loras = 0
        self.lora_adapters: list[LoRAAdapterInfo] = []
        self.lora_requests: list[LoRARequest] = []
        self.lora_answer: LoRAResponse | None = None

    def start(self) -> FakeScheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._zmq_context.destroy(linger=0)

    def stats(self) -> SchedulerStats:
        """What a StatsRequest would answer now."""
        with self._lock:
            used = sum(
                math.ceil((r.context.num_prompt_tokens + r.num_generated) / self.block_size)
                for r in self._running.values()
            )
            return SchedulerStats(
                num_requests_running=len(self._running),
                num_requests_waiting=0,
                num_kv_blocks_total=self.num_kv_blocks,
                num_kv_blocks_used=used,
                workers_ready=self.workers_ready,
                embedding_workers_ready=self.workers_ready,
                lora_adapters=list(self.lora_adapters),
                max_loras=self.max_loras,
            )

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Poll ``predicate`` until it holds or ``timeout_s`` passes; return its last value."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_step = time.monotonic()
        while not self._stop.is_set():
            # Idle, wait for a message (up to 50 ms, to see stop()); running, until the next
            # step, in whole milliseconds (ZeroMQ's unit: a fraction rounded down to 0 polled
            # without waiting, and an idle fake spun a core, slowing the tests beside it).
            with self._lock:
                idle = not self._running
            timeout_ms = 50 if idle else math.ceil(max(0.0, next_step - time.monotonic()) * 1000)
            if poller.poll(timeout=min(timeout_ms, 50)):
                identity, *_, frame = self._socket.recv_multipart()
                if not self.silent:
                    self._handle(identity, self._decode(frame))
            if time.monotonic() >= next_step:
                if not self.silent:
                    self._step()
                next_step = time.monotonic() + self.step_interval_s

    def _handle(self, identity: bytes, message: ApiToSchedulerMessage) -> None:
        if isinstance(message, ApiHello):
            self.hellos.append(message)
            if self.refuse_hello_with is not None:
                self._send(identity, HandshakeRefused(self.refuse_hello_with))
        elif isinstance(message, StatsRequest):
            self.num_stats_requests += 1
            self._send(identity, self.stats())
        elif isinstance(message, SubmitEmbeddings):
            with self._lock:
                self.embeddings_submitted.extend(message.contexts)
        elif isinstance(message, SubmitRequest):
            with self._lock:
                self.submitted.append(message.context)
                if self.reject_with is None:
                    self._running[message.context.request_id] = _Running(identity, message.context)
            if self.reject_with is not None:
                rejection = SchedulerResult.rejected_request(self.reject_with)
                self._send(identity, SchedulerResults({message.context.request_id: rejection}))
        elif isinstance(message, AbortRequests):
            self._abort(message.request_ids)
        elif isinstance(message, LoRAOperationRequest):
            self._send(identity, LoRAOperationResult(message.ticket, self._lora(message.request)))

    def _lora(self, request: LoRARequest) -> LoRAResponse:
        with self._lock:
            self.lora_requests.append(request)
            if self.lora_answer is not None:
                return self.lora_answer
            name = request.lora_name
            self.lora_adapters = [a for a in self.lora_adapters if a.name != name]
            if request.operation is LoRAOperation.LOAD:
                self.lora_adapters.append(LoRAAdapterInfo(name, request.lora_path or ""))
        return LoRAResponse(LoRAStatus.SUCCESS, f"done: {name}")

    def _abort(self, request_ids: list[str]) -> None:
        with self._lock:
            self.aborted.extend(request_ids)
            stopped = [self._running.pop(rid) for rid in request_ids if rid in self._running]
        for running in stopped:
            results = {running.context.request_id: SchedulerResult.cancelled()}
            self._send(running.identity, SchedulerResults(results=results))

    def _step(self) -> None:
        with self._lock:
            items = list(self._running.items())
        by_identity: dict[bytes, dict[str, SchedulerResult]] = {}
        for request_id, running in items:
            result = self._next_result(running)
            if result.stop_stream:
                with self._lock:
                    self._running.pop(request_id, None)
            by_identity.setdefault(running.identity, {})[request_id] = result
        for identity, results in by_identity.items():
            self._send(identity, SchedulerResults(results=results))

    def _next_result(self, running: _Running) -> SchedulerResult:
        context = running.context
        if (
            self.fail_with is not None
            and running.num_generated >= self.fail_after_tokens
            and context.request_id.endswith(self.fail_only_ending or "")
        ):
            return SchedulerResult.cancelled(error=self.fail_with)
        sequence = self.reply + ([self.eos_token_id] if self.eos_token_id is not None else [])
        room = context.max_new_tokens - running.num_generated
        tokens = []
        for _ in range(min(self.tokens_per_step, room)):
            index = running.num_generated + len(tokens)
            if self.repeat:
                tokens.append(self.reply[index % len(self.reply)])
            elif index < len(sequence):
                tokens.append(sequence[index])
        first_position = running.num_generated
        running.num_generated += len(tokens)
        status = GenerationStatus.ACTIVE
        if not self.repeat and running.num_generated >= len(sequence):
            status = GenerationStatus.END_OF_SEQUENCE
        elif running.num_generated >= context.max_new_tokens:
            status = GenerationStatus.MAXIMUM_LENGTH
        output = TextGenerationOutput(context.request_id, tokens, status)
        if context.logprobs is not None:
            positions = range(first_position, running.num_generated)
            output.log_probabilities = [fake_logprobs(tokens, positions, context.logprobs)]
        if context.prompt_logprobs is not None and first_position == 0:
            prompt = context.prompt_token_ids
            positions = range(1, len(prompt))
            output.prompt_log_probabilities = fake_logprobs(
                prompt[1:], positions, context.prompt_logprobs
            )
        if status is GenerationStatus.ACTIVE:
            return SchedulerResult.active(output)
        return SchedulerResult.complete(output)

    def _send(
        self, identity: bytes, message: SchedulerResults | SchedulerStats | HandshakeRefused
    ) -> None:
        self._socket.send_multipart([identity, self._encode(message)])


class UvicornThread:
    """Serves an ASGI app with a real uvicorn on 127.0.0.1 (a free port) in a daemon thread,
    so tests exercise real HTTP: streaming, and clients that disconnect."""

    def __init__(self, app, log_level: str = "warning") -> None:
        import socket

        import uvicorn

        # The protocol named, so that asyncio sets TCP_NODELAY on the accepted connections
        # (api_server.bind_address.inherited_listener says why that matters).
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._listener]}, daemon=True
        )

    def start(self, timeout_s: float = 10.0) -> UvicornThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._listener.close()


class ApiHarness:
    """A fake scheduler plus a real API server (uvicorn in a thread) talking to it.

    ``scheduler`` is the FakeScheduler (None: nothing listens), ``url`` the server's base URL,
    ``tokenizer`` the server's tokenizer. Engine timeouts are short so failure tests finish in
    about a second. ``api_key``, ``allowed_origins`` and ``limits`` (an ``HttpLimits``; None:
    the defaults) and ``embedding_model_dir`` go into the server's config;
    ``scheduler_timeout_s`` is how long the engine waits on a silent scheduler. ``bind_host``
    is the address the app is told it listens on (its ``Host`` check; None: no check);
    ``heartbeat_interval_s`` how often the engine pings while requests are in flight;
    ``scheduler_return_timeout_s`` how long requests wait for a scheduler that went away (0:
    they fail at once). ``logits_processor_names`` are the user logits processors requests may
    name.
    """

    MODEL_NAME = "smollm2-test"

    def __init__(
        self,
        model_dir,
        work_dir,
        max_model_len: int = 256,
        with_scheduler: bool = True,
        api_key: str | None = None,
        allowed_origins: tuple[str, ...] = (),
        limits=None,
        scheduler_timeout_s: float = 1.0,
        embedding_model_dir=None,
        bind_host: str | None = None,
        heartbeat_interval_s: float = 0.1,
        scheduler_return_timeout_s: float = 0.0,
        logits_processor_names: tuple[str, ...] = (),
    ) -> None:
        from api_server.app import create_app
        from api_server.config import ApiServerConfig, EngineClientConfig, HttpLimits

        address = f"ipc://{work_dir}/scheduler.ipc"
        self.scheduler = FakeScheduler(address).start() if with_scheduler else None
        engine = EngineClientConfig(
            scheduler_addr=address,
            submit_timeout_s=1.0,
            stats_timeout_s=1.0,
            scheduler_timeout_s=scheduler_timeout_s,
            heartbeat_interval_s=heartbeat_interval_s,
            scheduler_return_timeout_s=scheduler_return_timeout_s,
        )
        config = ApiServerConfig(
            model_dir,
            self.MODEL_NAME,
            max_model_len,
            engine,
            api_key,
            allowed_origins,
            limits or HttpLimits(),
            embedding_model_dir=embedding_model_dir,
            logits_processor_names=logits_processor_names,
            allow_runtime_lora_updating=True,
        )
        self.app = create_app(config, bind_host)
        self.server = UvicornThread(self.app).start()
        self.url = self.server.url
        self.tokenizer = self.app.state.tokenizer

    def close(self) -> None:
        self.server.stop()
        if self.scheduler is not None:
            self.scheduler.stop()


def sse_events(response) -> list[str]:
    """The ``data:`` payloads of an SSE body before ``[DONE]``, checking the framing."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")
    assert events[-1] == ""
    assert all(event.startswith("data: ") for event in events[:-1])
    return [event.removeprefix("data: ") for event in events[:-2]]
