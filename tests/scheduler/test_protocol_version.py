"""A worker or an API server of another protocol version is refused at its handshake, with a
reason naming both versions, over real sockets; the peers beside it are served as before."""

from __future__ import annotations

import msgspec

from interfaces.api_to_scheduler import StatsRequest, SubmitRequest
from interfaces.handshake import PROTOCOL_VERSION, ApiHello, HandshakeRefused
from interfaces.scheduler_to_worker import Shutdown
from interfaces.worker_to_scheduler import WorkerReady
from tests.support.scheduler_sockets import (
    TIMEOUT_MS,
    api_client,
    collect,
    ctx,
    decode_worker,
    encode,
    expected,
    receive,
    start_worker,
    stats,
)

NEWER = PROTOCOL_VERSION + 1
ADVICE = "run the same Switchyard version on every process"


def handshake(context, backend, frame: bytes) -> Shutdown | None:
    """Send ``frame`` as a worker's first from a new connection; the answer, if any."""
    worker = api_client(context, backend)
    worker.send(frame)
    answer = decode_worker(worker.recv()) if worker.poll(TIMEOUT_MS) else None
    worker.close(linger=0)
    return answer


def test_workers_of_another_protocol_version_are_refused_naming_both_versions(system):
    _, context, frontend, backend = system
    client = api_client(context, frontend)
    worker = start_worker(context, backend, client)
    worker.step_delay_s = 0.01
    client.send(encode(SubmitRequest(ctx("innocent", [4, 4], max_new_tokens=30))))
    newer = WorkerReady(NEWER, "fake", 64, 4, 256, group="newer")
    newer_shape = msgspec.msgpack.encode(["ready", NEWER, {"model": "fake"}, "more fields"])
    old_shape = msgspec.msgpack.encode(["ready", "fake", 64, 4, 256, 0, 1, "hybrid", "old"])
    speaks = (
        f"the worker speaks protocol version {NEWER}, and this scheduler speaks protocol "
        f"version {PROTOCOL_VERSION}: {ADVICE}"
    )
    sent_none = (
        "the worker sent no protocol version, and this scheduler speaks protocol version "
        f"{PROTOCOL_VERSION}: {ADVICE}"
    )
    assert handshake(context, backend, encode(newer)) == Shutdown(speaks)
    assert handshake(context, backend, newer_shape) == Shutdown(speaks)
    assert handshake(context, backend, old_shape) == Shutdown(sent_none)
    assert stats(client).num_kv_blocks_total == 64  # the innocent worker's pool alone
    assert collect(client, ["innocent"])[0] == {"innocent": expected([4, 4], 30)}
    assert not worker.got_shutdown.is_set()


def test_an_api_server_of_another_protocol_version_is_refused_then_ignored(system):
    server, context, frontend, backend = system
    innocent, matching, newer = (api_client(context, frontend) for _ in range(3))
    start_worker(context, backend, innocent)  # it sends no hello at all, and is served
    newer.send(encode(ApiHello(NEWER)))
    assert receive(newer) == HandshakeRefused(
        f"the API server speaks protocol version {NEWER}, and this scheduler speaks protocol "
        f"version {PROTOCOL_VERSION}: {ADVICE}"
    )
    newer.send(encode(SubmitRequest(ctx("ignored", [1]))))
    newer.send(encode(StatsRequest()))
    unversioned = api_client(context, frontend)  # a hello whose version is not a number
    unversioned.send(msgspec.msgpack.encode(["hello", "one"]))
    assert receive(unversioned) == HandshakeRefused(
        "the API server sent no protocol version, and this scheduler speaks protocol version "
        f"{PROTOCOL_VERSION}: {ADVICE}"
    )
    matching.send(encode(ApiHello()))  # needs no answer
    matching.send(encode(SubmitRequest(ctx("matching", [3], max_new_tokens=8))))
    innocent.send(encode(SubmitRequest(ctx("innocent", [2], max_new_tokens=8))))
    assert collect(matching, ["matching"])[0] == {"matching": expected([3], 8)}
    assert collect(innocent, ["innocent"])[0] == {"innocent": expected([2], 8)}
    assert server.placement.owner("ignored") is None
    assert not newer.poll(0)  # no result, no stats
