"""EngineClient against a bare ROUTER socket that the test drives message by message."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from api_server.config import EngineClientConfig
from api_server.engine_client import (
    EngineClient,
    MessageTooLarge,
    SchedulerUnavailable,
    StreamBacklogFull,
)
from interfaces import SchedulerResult, StructuredOutput, TextContext, TextGenerationOutput
from interfaces.api_to_scheduler import (
    MAX_API_MESSAGE_BYTES,
    AbortRequests,
    ApiToSchedulerMessage,
    StatsRequest,
    SubmitRequest,
)
from interfaces.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.handshake import PROTOCOL_VERSION, ApiHello, HandshakeRefused
from interfaces.outputs import GenerationStatus
from interfaces.scheduler_to_api import SchedulerResults, SchedulerStats
from tests.support.fake_scheduler import FakeScheduler

ROOT = Path(__file__).resolve().parents[2]
encode = msgpack_numpy_encoder()
decode = msgpack_numpy_decoder(ApiToSchedulerMessage)
REFUSAL = (
    f"the API server speaks protocol version {PROTOCOL_VERSION}, and this scheduler speaks "
    f"protocol version {PROTOCOL_VERSION + 1}: run the same Switchyard version on every process"
)
CONTEXT = TextContext(request_id="r1", prompt_token_ids=[1, 2], max_length=10)


def stats(num_running: int) -> SchedulerStats:
    return SchedulerStats(num_running, 0, 10, num_running, True)


def results(request_id: str, result: SchedulerResult) -> bytes:
    return encode(SchedulerResults(results={request_id: result}))


def output(tokens: list[int], status=GenerationStatus.ACTIVE) -> TextGenerationOutput:
    return TextGenerationOutput("r1", tokens, status)


async def receive(router: zmq.asyncio.Socket) -> tuple[bytes, object]:
    identity, frame = await asyncio.wait_for(router.recv_multipart(), 5)
    return identity, decode(frame)


async def message_types_within(router: zmq.asyncio.Socket, seconds: float) -> set[type]:
    """The types of the messages the router receives in the next ``seconds``."""
    messages = set()
    deadline = asyncio.get_running_loop().time() + seconds
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            _, frame = await asyncio.wait_for(router.recv_multipart(), left)
        except asyncio.TimeoutError:
            break
        messages.add(type(decode(frame)))
    return messages


async def streaming(
    client: EngineClient, router: zmq.asyncio.Socket, context: TextContext = CONTEXT
) -> tuple[AsyncIterator, bytes]:
    """Start ``context``'s stream and answer its submission with token 5, which it yields."""
    stream = client.generate(context)
    first = asyncio.ensure_future(anext(stream))
    identity, _ = await receive(router)
    result = SchedulerResult.active(output([5]))
    await router.send_multipart([identity, results(context.request_id, result)])
    assert (await first).result.tokens == [5]
    return stream, identity


def run_with_router(
    tmp_path: Path,
    test: Callable[..., Awaitable[None]],
    bind: bool = True,
    max_stream_backlog: int = 1024,
    scheduler_return_timeout_s: float = 0.0,
):
    """Run ``test(client, router)`` with an EngineClient connected to a ROUTER (bound or not)."""
    address = f"ipc://{tmp_path}/scheduler.ipc"
    config = EngineClientConfig(
        address,
        submit_timeout_s=0.5,
        stats_timeout_s=0.5,
        scheduler_timeout_s=0.6,
        heartbeat_interval_s=0.1,
        max_stream_backlog=max_stream_backlog,
        scheduler_return_timeout_s=scheduler_return_timeout_s,
    )

    async def main() -> None:
        zmq_context = zmq.asyncio.Context()
        router = zmq_context.socket(zmq.ROUTER)
        if bind:
            router.bind(address)
        client = EngineClient(config)
        await client.start()
        try:
            if bind:  # every connection opens with the protocol version
                assert (await receive(router))[1] == ApiHello(PROTOCOL_VERSION)
            await asyncio.wait_for(test(client, router), 10)
        finally:
            await client.close()
            zmq_context.destroy(linger=0)

    asyncio.run(main())


def test_results_stream_until_complete_and_bad_frames_are_dropped(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream = client.generate(CONTEXT)
        first = asyncio.ensure_future(anext(stream))
        identity, message = await receive(router)
        assert message == SubmitRequest(CONTEXT)
        await router.send_multipart([identity, b"\xc1 not msgpack"])
        await router.send_multipart(
            [identity, results("someone-else", SchedulerResult.active(output([9])))]
        )
        await router.send_multipart([identity, results("r1", SchedulerResult.active(output([5])))])
        assert (await first).result.tokens == [5]
        done = SchedulerResult.complete(output([6, 2], GenerationStatus.END_OF_SEQUENCE))
        await router.send_multipart([identity, results("r1", done)])
        assert [item async for item in stream] == [done]
        assert client.num_requests_in_flight == 0
        with pytest.raises(asyncio.TimeoutError):  # a finished request is not aborted
            await asyncio.wait_for(router.recv_multipart(), 0.2)

    run_with_router(tmp_path, test)


def test_leaving_a_stream_early_aborts_the_request(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, identity = await streaming(client, router)
        await stream.aclose()
        assert await receive(router) == (identity, AbortRequests(["r1"]))
        assert client.num_requests_in_flight == 0

    run_with_router(tmp_path, test)


def test_cancelling_the_consumer_aborts_the_request(tmp_path: Path) -> None:
    async def consume(client: EngineClient) -> None:
        async for _ in client.generate(CONTEXT):
            pass

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        task = asyncio.ensure_future(consume(client))
        identity, _ = await receive(router)
        task.cancel()
        assert await receive(router) == (identity, AbortRequests(["r1"]))

    run_with_router(tmp_path, test)


def test_concurrent_stats_get_the_replies_to_their_own_requests(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        first = asyncio.ensure_future(client.stats())
        second = asyncio.ensure_future(client.stats())
        identity, message = await receive(router)
        assert message == StatsRequest()
        await receive(router)
        await router.send_multipart([identity, encode(stats(1))])
        await asyncio.sleep(0.05)
        assert first.done() and not second.done()
        await router.send_multipart([identity, encode(stats(2))])
        assert (await first, await second) == (stats(1), stats(2))

    run_with_router(tmp_path, test)


def test_stats_survive_a_lost_request(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        with pytest.raises(SchedulerUnavailable):
            await client.stats()
        await receive(router)  # the first request is lost: never answered
        second = asyncio.ensure_future(client.stats())
        identity, _ = await receive(router)
        await router.send_multipart([identity, encode(stats(2))])
        assert await second == stats(2)
        third = asyncio.ensure_future(client.stats())
        identity, _ = await receive(router)
        await router.send_multipart([identity, encode(stats(3))])
        assert await asyncio.wait_for(third, 0.3) == stats(3)  # paired again: no timeout wait

    run_with_router(tmp_path, test)


def test_stats_times_out(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        with pytest.raises(SchedulerUnavailable, match=r"within 0\.5 s"):
            await client.stats()

    run_with_router(tmp_path, test)


def test_a_silent_scheduler_fails_requests_in_flight(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream = client.generate(CONTEXT)
        with pytest.raises(SchedulerUnavailable, match="has not answered"):
            await anext(stream)
        _, message = await receive(router)
        assert message == SubmitRequest(CONTEXT)
        assert (await receive(router))[1] == StatsRequest()  # the heartbeat pinged first
        assert client.num_requests_in_flight == 0

    run_with_router(tmp_path, test)


STALL_S = 3 * 0.6
"""Three times ``run_with_router``'s scheduler timeout."""


def test_what_the_scheduler_sent_during_a_stall_of_the_loop_is_read_not_failed(tmp_path: Path):
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, identity = await streaming(client, router)
        done = SchedulerResult.complete(output([6, 2], GenerationStatus.END_OF_SEQUENCE))
        await router.send_multipart([identity, results("r1", done)])
        time.sleep(STALL_S)  # blocks the event loop: the reader and the heartbeat alike
        assert [item async for item in stream] == [done]

    run_with_router(tmp_path, test)


def test_after_a_stall_of_the_loop_the_scheduler_is_pinged_before_it_is_judged(tmp_path: Path):
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, identity = await streaming(client, router)
        time.sleep(STALL_S)  # nothing arrives meanwhile: the stall is still not silence
        assert await receive(router) == (identity, StatsRequest())
        await router.send_multipart([identity, encode(stats(1))])
        done = SchedulerResult.complete(output([6, 2], GenerationStatus.END_OF_SEQUENCE))
        await router.send_multipart([identity, results("r1", done)])
        assert [item async for item in stream] == [done]

    run_with_router(tmp_path, test)


def test_a_scheduler_silent_after_a_stall_of_the_loop_still_fails_requests(tmp_path: Path):
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, _ = await streaming(client, router)
        time.sleep(STALL_S)
        stalled_until = time.monotonic()
        with pytest.raises(SchedulerUnavailable, match="has not answered"):
            await anext(stream)
        assert time.monotonic() - stalled_until < STALL_S  # one timeout and a tick or two
        assert client.num_requests_in_flight == 0

    run_with_router(tmp_path, test)


def test_no_scheduler_fails_the_submit(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        with pytest.raises(SchedulerUnavailable, match=r"did not accept the request within 0\.5 s"):
            await anext(client.generate(CONTEXT))
        assert client.num_requests_in_flight == 0

    run_with_router(tmp_path, test, bind=False)


def test_a_request_id_in_flight_cannot_be_reused(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream = client.generate(CONTEXT)
        first = asyncio.ensure_future(anext(stream))
        await receive(router)
        with pytest.raises(ValueError, match="already in flight"):
            await anext(client.generate(CONTEXT))
        first.cancel()

    run_with_router(tmp_path, test)


def test_a_frame_the_scheduler_would_not_take_is_refused_before_it_is_sent(tmp_path: Path):
    grammar = StructuredOutput("grammar", "x" * MAX_API_MESSAGE_BYTES)
    huge = TextContext(
        request_id="r1", prompt_token_ids=[1], max_length=2, structured_output=grammar
    )

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        with pytest.raises(MessageTooLarge) as raised:
            await anext(client.generate(huge))
        assert raised.value.status_code == 413
        assert raised.value.message == (
            f"The request takes {len(encode(SubmitRequest(huge)))} bytes on its way to the "
            f"scheduler, more than the limit of {MAX_API_MESSAGE_BYTES} bytes; send a smaller "
            "prompt, schema or stop list"
        )
        assert client.num_requests_in_flight == 0
        stream = client.generate(CONTEXT)  # the connection still serves
        first = asyncio.ensure_future(anext(stream))
        identity, message = await receive(router)
        assert message == SubmitRequest(CONTEXT)
        done = SchedulerResult.complete(output([2], GenerationStatus.END_OF_SEQUENCE))
        await router.send_multipart([identity, results("r1", done)])
        assert await first == done

    run_with_router(tmp_path, test)


def test_a_consumer_that_stops_reading_is_aborted_and_told_why(tmp_path: Path) -> None:
    other = TextContext(request_id="r2", prompt_token_ids=[1, 2], max_length=10)

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stalled, reading = client.generate(CONTEXT), client.generate(other)
        first = asyncio.ensure_future(anext(stalled))
        identity, _ = await receive(router)
        other_first = asyncio.ensure_future(anext(reading))
        await receive(router)
        await router.send_multipart([identity, results("r1", SchedulerResult.active(output([5])))])
        assert (await first).result.tokens == [5]
        for token in range(10, 14):  # nobody reads r1 now: the fourth result is one too many
            await router.send_multipart(
                [identity, results("r1", SchedulerResult.active(output([token])))]
            )
        assert await receive(router) == (identity, AbortRequests(["r1"]))
        assert client.num_requests_in_flight == 1
        with pytest.raises(StreamBacklogFull) as raised:
            await anext(stalled)  # the three results it left unread were dropped
        assert raised.value.message == (
            "The client stopped reading the response: more than 3 results were waiting for it "
            "(--max-stream-backlog), so the request was aborted"
        )
        assert await message_types_within(router, 0.3) <= {StatsRequest}  # aborted once only
        done = SchedulerResult.complete(output([7], GenerationStatus.END_OF_SEQUENCE))
        await router.send_multipart([identity, results("r2", done)])
        assert await other_first == done

    run_with_router(tmp_path, test, max_stream_backlog=3)


def test_the_hello_is_the_first_frame_even_before_the_scheduler_listens(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        first = asyncio.ensure_future(anext(client.generate(CONTEXT)))
        await asyncio.sleep(0.05)  # the submit waits for a connection, behind the hello
        router.bind(f"ipc://{tmp_path}/scheduler.ipc")
        identity, hello = await receive(router)
        assert hello == ApiHello(PROTOCOL_VERSION)
        assert await receive(router) == (identity, SubmitRequest(CONTEXT))
        first.cancel()

    run_with_router(tmp_path, test, bind=False)


def test_a_refused_hello_fails_every_request_and_says_why(tmp_path: Path) -> None:
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        router.bind(f"ipc://{tmp_path}/scheduler.ipc")
        identity, _ = await receive(router)  # the hello
        in_flight = asyncio.ensure_future(anext(client.generate(CONTEXT)))
        await receive(router)
        await router.send_multipart([identity, encode(HandshakeRefused(REFUSAL))])
        assert await client.refused() == REFUSAL
        reason = f"the scheduler refused this API server: {REFUSAL}"
        with pytest.raises(SchedulerUnavailable) as raised:
            await in_flight
        assert str(raised.value) == reason
        with pytest.raises(SchedulerUnavailable) as raised:
            await anext(client.generate(CONTEXT))
        assert str(raised.value) == reason

    run_with_router(tmp_path, test, bind=False)


def test_an_api_server_the_scheduler_refuses_exits_1_saying_why(
    default_model_dir: Path, tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/scheduler.ipc"
    scheduler = FakeScheduler(address)
    scheduler.refuse_hello_with = REFUSAL
    scheduler.start()
    argv = [sys.executable, "-m", "api_server", "--model", str(default_model_dir)]
    argv += ["--scheduler-addr", address, "--port", "0"]
    try:
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        scheduler.stop()
    assert result.returncode == 1, result.stderr
    assert f"the scheduler refused this API server: {REFUSAL}" in result.stderr
    assert scheduler.hellos == [ApiHello(PROTOCOL_VERSION)]


async def next_request(router: zmq.asyncio.Socket, ready: bool) -> tuple[bytes, object]:
    """The next message but stats requests, which are answered with ``workers_ready=ready``."""
    while True:
        identity, message = await receive(router)
        if not isinstance(message, StatsRequest):
            return identity, message
        await router.send_multipart([identity, encode(SchedulerStats(0, 0, 10, 0, ready))])


async def nothing_submitted_without_a_worker(router: zmq.asyncio.Socket) -> None:
    """On a scheduler that came back: the API server's hello, then (its stats answered with
    no worker ready) no request for a while."""
    assert (await receive(router))[1] == ApiHello(PROTOCOL_VERSION)
    waiting = asyncio.ensure_future(next_request(router, ready=False))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(waiting), 0.6)
    waiting.cancel()


async def restart(router: zmq.asyncio.Socket, address: str) -> zmq.asyncio.Socket:
    """Close ``router`` (the scheduler dies) and bind a new one at ``address``."""
    context = router.context
    router.close(linger=0)
    await asyncio.sleep(0.3)  # the client sees the connection drop
    restarted = context.socket(zmq.ROUTER)
    restarted.bind(address)
    return restarted


def test_a_stream_waits_for_a_restarted_scheduler_and_goes_on_after_its_tokens(tmp_path: Path):
    """The request is submitted again only once the new scheduler has a worker, with the
    tokens already received (and no prompt log probabilities: they came first); the stream
    pauses and continues, nothing repeated or lost."""
    context = msgspec.structs.replace(CONTEXT, prompt_logprobs=1)

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, identity = await streaming(client, router, context)
        await router.send_multipart([identity, results("r1", SchedulerResult.active(output([6])))])
        tokens = [[5], (await anext(stream)).result.tokens]
        router = await restart(router, f"ipc://{tmp_path}/scheduler.ipc")
        try:
            await nothing_submitted_without_a_worker(router)
            identity, message = await next_request(router, ready=True)
            resumed = msgspec.structs.replace(
                context, generated_token_ids=[5, 6], prompt_logprobs=None
            )
            assert message == SubmitRequest(resumed)
            done = SchedulerResult.complete(output([7], GenerationStatus.END_OF_SEQUENCE))
            await router.send_multipart([identity, results("r1", done)])
            rest = [item async for item in stream]
            assert tokens + [item.result.tokens for item in rest] == [[5], [6], [7]]
            assert rest[-1].stop_stream and client.num_requests_in_flight == 0
        finally:
            router.close(linger=0)

    run_with_router(tmp_path, test, scheduler_return_timeout_s=10.0)


def test_what_cannot_wait_fails_at_once_and_the_rest_after_the_return_timeout(tmp_path: Path):
    """Embeddings fail when the connection drops; a text request waits, and so does a new one,
    and both fail naming the bound when no scheduler comes back within it."""
    from interfaces.embeddings import EmbeddingsContext

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, _ = await streaming(client, router)
        embedding = asyncio.ensure_future(client.embed([EmbeddingsContext("e1", [1, 2])]))
        await next_request(router, ready=True)
        router.close(linger=0)
        with pytest.raises(SchedulerUnavailable, match="lost the connection"):
            await embedding
        new = client.generate(msgspec.structs.replace(CONTEXT, request_id="r2"))
        with pytest.raises(SchedulerUnavailable, match=r"did not come back within 1\.5 s"):
            await anext(new)
        with pytest.raises(SchedulerUnavailable, match=r"did not come back within 1\.5 s"):
            await anext(stream)
        assert client.num_requests_in_flight == 0

    run_with_router(tmp_path, test, scheduler_return_timeout_s=1.5)


async def away_when_a_request_arrives(
    client: EngineClient, router: zmq.asyncio.Socket, address: str
) -> tuple[zmq.asyncio.Socket, TextContext, asyncio.Future]:
    """The scheduler goes away, then request "late" arrives (its first result, to come), then
    a scheduler binds ``address`` again: that new ROUTER, the late context and its future."""
    context = router.context
    router.close(linger=0)
    await asyncio.sleep(0.3)  # the monitor reports the drop
    late = msgspec.structs.replace(CONTEXT, request_id="late")
    arrived = asyncio.ensure_future(anext(client.generate(late)))
    await asyncio.sleep(0.3)
    assert not arrived.done()
    restarted = context.socket(zmq.ROUTER)
    restarted.bind(address)
    return restarted, late, arrived


def test_a_request_that_arrives_while_the_scheduler_is_away_waits_for_its_return(tmp_path: Path):
    """Submitted neither while the connection is down nor before the new scheduler has a
    worker; then it goes, as if nothing had happened."""

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, identity = await streaming(client, router)
        address = f"ipc://{tmp_path}/scheduler.ipc"
        router, late, arrived = await away_when_a_request_arrives(client, router, address)
        try:
            await nothing_submitted_without_a_worker(router)
            submitted = {}
            for _ in range(2):  # the stream in flight, submitted again, and the late one
                identity, message = await next_request(router, ready=True)
                submitted[message.context.request_id] = message
            assert submitted["late"] == SubmitRequest(late)
            done = SchedulerResult.complete(output([7], GenerationStatus.END_OF_SEQUENCE))
            await router.send_multipart([identity, results("late", done)])
            assert (await arrived).result.tokens == [7]
            await router.send_multipart([identity, results("r1", done)])
            assert [item.result.tokens async for item in stream][-1] == [7]
        finally:
            router.close(linger=0)

    run_with_router(tmp_path, test, scheduler_return_timeout_s=10.0)


def test_a_new_request_told_why_when_the_scheduler_comes_back_without_a_worker(tmp_path: Path):
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        address = f"ipc://{tmp_path}/scheduler.ipc"
        router, _, arrived = await away_when_a_request_arrives(client, router, address)
        answering = asyncio.ensure_future(next_request(router, ready=False))  # never a worker
        try:
            with pytest.raises(SchedulerUnavailable, match=r"no worker served within 1\.5 s"):
                await arrived
        finally:
            answering.cancel()
            router.close(linger=0)

    run_with_router(tmp_path, test, scheduler_return_timeout_s=1.5)


def test_a_new_request_waiting_for_a_scheduler_that_refuses_this_server_is_told_so(
    tmp_path: Path,
):
    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        address = f"ipc://{tmp_path}/scheduler.ipc"
        router, _, arrived = await away_when_a_request_arrives(client, router, address)
        try:
            identity, hello = await receive(router)
            assert hello == ApiHello(PROTOCOL_VERSION)
            await router.send_multipart([identity, encode(HandshakeRefused(REFUSAL))])
            with pytest.raises(SchedulerUnavailable, match="refused this API server"):
                await asyncio.wait_for(arrived, 5)
        finally:
            router.close(linger=0)

    run_with_router(tmp_path, test, scheduler_return_timeout_s=30.0)


def test_only_requests_submitted_before_the_connection_dropped_are_submitted_again() -> None:
    from api_server.resubmission import Resubmissions

    kept = Resubmissions()
    for request_id in ("r1", "r2", "r3", "ended"):
        kept.submitting(msgspec.structs.replace(CONTEXT, request_id=request_id))
        if request_id != "r3":  # r3's frame has not left
            kept.submitted(request_id)
    kept.received("r1", SchedulerResult.active(output([5, 6])))
    kept.received("ended", SchedulerResult.complete(output([7], GenerationStatus.END_OF_SEQUENCE)))
    kept.lost_connection()
    kept.submitted("r2")  # it left on the connection that came back
    assert kept.waiting() == ["r1"]
    assert kept.due() == [msgspec.structs.replace(CONTEXT, generated_token_ids=[5, 6])]
    assert kept.due() == []  # once per connection
    kept.forget("r1")
    assert len(kept) == 2 and "r1" not in kept and "ended" not in kept


def test_a_scheduler_back_without_a_worker_fails_the_waiting_streams_at_the_bound(tmp_path):
    """The connection is back, but no worker serves: the streams do not wait forever."""

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        stream, _ = await streaming(client, router)
        router = await restart(router, f"ipc://{tmp_path}/scheduler.ipc")
        try:
            assert (await receive(router))[1] == ApiHello(PROTOCOL_VERSION)
            answering = asyncio.ensure_future(next_request(router, ready=False))
            with pytest.raises(SchedulerUnavailable, match=r"no worker served within 1\.5 s"):
                await anext(stream)
            assert client.num_requests_in_flight == 0
            answering.cancel()
        finally:
            router.close(linger=0)

    run_with_router(tmp_path, test, scheduler_return_timeout_s=1.5)


def test_a_server_shutting_down_does_not_wait_for_the_scheduler(tmp_path: Path) -> None:
    """While draining, nothing will start the scheduler again for this server: a stream that
    waits for it fails at once, and so does one whose connection drops afterwards."""

    async def test(client: EngineClient, router: zmq.asyncio.Socket) -> None:
        waiting, _ = await streaming(client, router)
        router.close(linger=0)
        await asyncio.sleep(0.3)  # the client sees the connection drop; the stream waits
        assert client.num_requests_in_flight == 1
        client.stop_waiting()
        with pytest.raises(SchedulerUnavailable, match="lost the connection"):
            await anext(waiting)
        assert client.num_requests_in_flight == 0

    run_with_router(tmp_path, test, scheduler_return_timeout_s=10.0)
