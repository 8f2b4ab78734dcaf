"""The scheduler's side of each peer's handshake: whom it refuses, and what it answers them.

A peer of another protocol version (``interfaces.handshake``) is refused at its handshake, even
one whose frame does not decode as this version's (its head is read with ``frame_head``): a
worker gets ``Shutdown`` with the reason, an API server ``HandshakeRefused``, and that API
server's frames are ignored until it disconnects. A ``SubmitRequest`` whose values do not decode
is refused to its sender if its request id does, so the sender does not wait for it forever.

``Handshakes`` decides and logs; the server sends what it returns (None: nothing to send) and
routes everything else.
"""

from __future__ import annotations

import logging

import msgspec

from interfaces import SchedulerResult
from interfaces.handshake import ApiHello, HandshakeRefused, frame_head, version_mismatch
from interfaces.scheduler_to_api import SchedulerResults
from interfaces.scheduler_to_worker import Shutdown
from interfaces.worker_to_scheduler import WorkerReady

logger = logging.getLogger(__name__)

READY_TAG = WorkerReady.__struct_config__.tag
HELLO_TAG = ApiHello.__struct_config__.tag


class _RequestIdOnly(msgspec.Struct):
    request_id: str


class _SubmittedId(msgspec.Struct, tag="submit", array_like=True):
    """Just the request id of a ``SubmitRequest`` whose values did not decode, to refuse it."""

    context: _RequestIdOnly


class Handshakes:
    """The protocol-version check of every peer, and the API servers it refused."""

    def __init__(self) -> None:
        self._refused_api_servers: set[bytes] = set()
        """API servers refused at their ``ApiHello``, until they disconnect."""
        self._decode_submitted_id = msgspec.msgpack.Decoder(_SubmittedId)

    def refused(self, client_id: bytes) -> bool:
        """Whether API server ``client_id`` was refused: its frames are to be ignored."""
        return client_id in self._refused_api_servers

    def forget(self, client_id: bytes) -> None:
        """API server ``client_id`` disconnected; an identity that comes back starts afresh."""
        self._refused_api_servers.discard(client_id)

    def on_hello(self, client_id: bytes, version: int | None) -> HandshakeRefused | None:
        """An API server speaks protocol ``version``: one of another version is refused (it
        exits) and its frames are ignored from now on; a matching one needs no answer."""
        reason = version_mismatch("API server", version)
        if reason is None:
            return None
        logger.error("refused an API server: %s", reason)
        self._refused_api_servers.add(client_id)
        return HandshakeRefused(reason)

    def on_undecodable_api_frame(
        self, client_id: bytes, payload: memoryview, error: Exception
    ) -> HandshakeRefused | SchedulerResults | None:
        """An API server's frame that did not decode: an ``ApiHello`` of another version's shape
        is refused (``on_hello``); a ``SubmitRequest`` whose id decoded is answered with its
        rejection; anything else is dropped (logged)."""
        tag, version = frame_head(payload)
        if tag == HELLO_TAG and version_mismatch("API server", version) is not None:
            return self.on_hello(client_id, version)
        logger.warning("dropped a malformed frame from an API server: %s", error)
        try:
            request_id = self._decode_submitted_id.decode(payload).context.request_id
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None  # nothing to answer: its id cannot be had
        rejection = SchedulerResult.rejected_request(f"the request is malformed: {error}")
        return SchedulerResults({request_id: rejection})

    def on_undecodable_worker_frame(self, payload: memoryview, error: Exception) -> Shutdown | None:
        """A worker's frame that did not decode: a ``WorkerReady`` of another version's shape
        is refused (``Shutdown`` with the reason); anything else is dropped (logged)."""
        tag, version = frame_head(payload)
        if tag == READY_TAG and version_mismatch("worker", version) is not None:
            return self._refuse_worker(version)
        logger.warning("dropped a malformed frame from a worker: %s", error)
        return None

    def on_worker_ready(self, ready: WorkerReady) -> Shutdown | None:
        """``Shutdown`` with the reason for a worker of another protocol version (it holds no
        place in any group, so nothing else changes); None when the versions agree."""
        if version_mismatch("worker", ready.protocol_version) is None:
            return None
        return self._refuse_worker(ready.protocol_version)

    def _refuse_worker(self, version: int | None) -> Shutdown:
        reason = version_mismatch("worker", version)
        logger.error("refused a worker: %s", reason)
        return Shutdown(reason)
