"""The handshake's shapes: what any version can read of a peer's first frame."""

from __future__ import annotations

import msgspec

from interfaces import msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.api_to_scheduler import ApiToSchedulerMessage
from interfaces.handshake import (
    PROTOCOL_VERSION,
    ApiHello,
    HandshakeRefused,
    HandshakeVersion,
    frame_head,
    version_mismatch,
)
from interfaces.scheduler_to_api import SchedulerToApiMessage
from interfaces.worker_to_scheduler import WorkerReady

encode = msgpack_numpy_encoder()


def test_the_handshake_messages_round_trip_in_their_unions():
    hello, refused = ApiHello(), HandshakeRefused("no")
    assert msgpack_numpy_decoder(ApiToSchedulerMessage)(encode(hello)) == hello
    assert msgpack_numpy_decoder(SchedulerToApiMessage)(encode(refused)) == refused
    assert hello.protocol_version == PROTOCOL_VERSION


def test_the_version_is_read_from_a_handshake_of_any_shape():
    ready = WorkerReady(PROTOCOL_VERSION, "m", 8, 16, 64)
    read = msgspec.msgpack.Decoder(HandshakeVersion)
    assert read.decode(encode(ready)) == HandshakeVersion("ready", PROTOCOL_VERSION)
    assert read.decode(encode(ApiHello(7))) == HandshakeVersion("hello", 7)
    assert frame_head(msgspec.msgpack.encode(["ready", 9, {"a": "field"}, []])) == ("ready", 9)
    assert frame_head(msgspec.msgpack.encode(["ready", "m", 8, 16, 64])) == ("ready", None)
    assert frame_head(msgspec.msgpack.encode({"ready": 1})) == (None, None)
    assert frame_head(b"\xc1 not msgpack") == (None, None)


def test_a_mismatch_names_both_versions():
    assert version_mismatch("worker", PROTOCOL_VERSION) is None
    assert version_mismatch("API server", PROTOCOL_VERSION + 1) == (
        f"the API server speaks protocol version {PROTOCOL_VERSION + 1}, and this scheduler "
        f"speaks protocol version {PROTOCOL_VERSION}: run the same Switchyard version on every "
        "process"
    )
    assert version_mismatch("worker", None).startswith("the worker sent no protocol version, ")
