"""The wire protocol's version, and the first message each peer sends the scheduler.

Every message shape on the internal sockets belongs to one ``PROTOCOL_VERSION``. A peer says
which version it speaks before anything else: an API server with ``ApiHello`` when it connects,
a worker as the first field of ``WorkerReady``. A scheduler of another version refuses it then,
with a reason naming both versions (``version_mismatch``), instead of failing on a later frame
whose shape it does not know.

The shapes here never change from one version to the next, so that peers of any two versions
can read them: the version is the first field after the tag of ``ApiHello`` and of
``WorkerReady`` (``HandshakeVersion`` reads just that much of either), and a refusal is
``HandshakeRefused`` to an API server and ``Shutdown`` with a reason to a worker.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 3
"""The version of every message shape in interfaces/: raise it with any change to one."""


class ApiHello(msgspec.Struct, tag="hello", array_like=True):
    """An API server's first frame to the scheduler: the protocol version it speaks."""

    protocol_version: int = PROTOCOL_VERSION


class HandshakeRefused(msgspec.Struct, tag="refused", array_like=True):
    """The scheduler's answer to an ``ApiHello`` of another version: the API server logs
    ``reason`` and exits 1."""

    reason: str


class HandshakeVersion(msgspec.Struct, array_like=True):
    """The tag and protocol version at the head of a handshake frame of any version (msgspec
    ignores the fields that follow), for a frame that does not decode as this version's."""

    tag: str
    protocol_version: int


class _Tagged(msgspec.Struct, array_like=True):
    tag: str


_decode_version = msgspec.msgpack.Decoder(HandshakeVersion)
_decode_tag = msgspec.msgpack.Decoder(_Tagged)


def frame_head(frame: bytes | memoryview) -> tuple[str | None, int | None]:
    """The tag and the protocol version at the head of a frame of any version, for one that
    did not decode as this version's messages: (None, None) if it has no tag; the version is
    None where none follows the tag (a ``WorkerReady`` from before versions: the model's name
    came first)."""
    try:
        head = _decode_version.decode(frame)
        return head.tag, head.protocol_version
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    try:
        return _decode_tag.decode(frame).tag, None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None


def version_mismatch(peer: str, peer_version: int | None) -> str | None:
    """Why a peer (``"worker"``, ``"API server"``) speaking ``peer_version`` (None: it sent
    none) cannot talk to this process, naming both versions; None when the versions agree."""
    if peer_version == PROTOCOL_VERSION:
        return None
    spoken = (
        "sent no protocol version"
        if peer_version is None
        else f"speaks protocol version {peer_version}"
    )
    return (
        f"the {peer} {spoken}, and this scheduler speaks protocol version {PROTOCOL_VERSION}: "
        "run the same Switchyard version on every process"
    )
