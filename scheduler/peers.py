"""Which peer of a ROUTER socket went away: ZeroMQ's socket monitor, mapped to routing identities.

A ROUTER hides its connections; its monitor reports ``DISCONNECTED`` with the file descriptor of
the connection that closed, and every received message carries the descriptor it came in on
(``ZMQ_SRCFD``). ``PeerTracker`` joins the two, so the scheduler learns at once, by identity,
that a worker or an API server process died (its kernel closes the socket), and over TCP that a
silent host was dropped by ZeroMQ's heartbeats.

Call ``disconnected()`` before reading the ROUTER's messages in each loop iteration: a
disconnection is queued on the monitor before its descriptor can be reused by a new connection,
so reading the monitor first never blames a new peer for an old peer's departure.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message


class PeerTracker:
    """Routing identities of the peers of one ROUTER, by connection, and their departures."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        """A PAIR socket; poll it for POLLIN alongside the ROUTER."""
        self._identity_by_fd: dict[int, bytes] = {}

    def saw(self, identity: bytes, frame: zmq.Frame) -> None:
        """Record that ``identity`` sent ``frame`` (received with ``copy=False``)."""
        self._identity_by_fd[frame.get(zmq.SRCFD)] = identity

    def disconnected(self) -> list[bytes]:
        """Identities whose connection closed since the last call (without blocking)."""
        gone = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            identity = self._identity_by_fd.pop(event["value"], None)
            if identity is not None:
                gone.append(identity)
        return gone

    def close(self) -> None:
        self.monitor.close(linger=0)
