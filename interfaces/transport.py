"""Security of the internal ZeroMQ sockets: where they may bind, CURVE keys, heartbeats.

The scheduler binds two ROUTERs and a decode worker binds its KV-transfer socket; API servers
and workers connect. Every socket belongs to one ``Link`` (``interfaces.curve_keys``): the
scheduler's frontend (``FRONTEND``), its backend (``BACKEND``) or a KV transfer
(``KV_TRANSFER``). So:

- a process that binds makes one ``Binder`` per ZeroMQ context (``security.binder(context)``)
  and binds every socket with ``binder.bind(socket, address, link)``; ``binder.close()`` after
  closing the sockets and before ``context.term()``;
- a process that connects calls ``security.connect(socket, address, link)``.

Sockets bind ``ipc://``, ``inproc://`` or loopback ``tcp://`` unless the operator passes
``--allow-remote-bind``. Cross-host traffic should also be authenticated and encrypted with
CURVE: ``switchyard keygen --output DIR`` writes one key pair per role, and each bound socket
accepts only the public key of its link's client role (an API server's key cannot register as
a worker). Which files each process needs: ``interfaces.curve_keys.FILES_BY_PROCESS``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import zmq
from zmq.auth.thread import ThreadAuthenticator

from interfaces import envs
from interfaces.curve_keys import (
    BACKEND,
    FRONTEND,
    KV_TRANSFER,
    Link,
    generate_curve_keys,
    key_pair,
    public_key,
)
from interfaces.settings import add_flags, from_args, setting

__all__ = ["BACKEND", "FRONTEND", "KV_TRANSFER", "Link", "generate_curve_keys"]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
HEARTBEAT_TTL_MS = 3000


def check_bind_address(address: str, allow_remote: bool) -> None:
    """Raise ``ValueError`` unless ``address`` may be bound.

    ``ipc://`` and ``inproc://`` always may; ``tcp://`` only on a loopback host (127.0.0.0/8,
    ::1, localhost) unless ``allow_remote``. Other transports are refused.
    """
    if address.startswith(("ipc://", "inproc://")):
        return
    if not address.startswith("tcp://"):
        raise ValueError(
            f"cannot bind {address!r}: Switchyard's sockets use ipc://, inproc:// or tcp://"
        )
    if allow_remote or is_loopback(_tcp_host(address)):
        return
    raise ValueError(
        f"refusing to bind {address}: other hosts could reach it, and the internal ZeroMQ "
        "traffic carries prompts and outputs. Bind ipc:// or tcp://127.0.0.1, or pass "
        "--allow-remote-bind for a multi-host deployment, together with --curve-keys-dir so "
        "the traffic is authenticated and encrypted (CURVE keys: `switchyard keygen`)."
    )


def enable_heartbeats(socket: zmq.Socket) -> None:
    """Ping the peer every second and drop a connection silent for 3 s (a peer whose host
    vanished sends no TCP reset, so without heartbeats the connection would look alive)."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)


@dataclass(frozen=True)
class TransportSecurity:
    """How a process's internal sockets bind and connect.

    ``curve_keys_dir`` None: plaintext, unauthenticated ZeroMQ (fine on ipc:// and loopback).
    A directory that does not exist raises ``ValueError`` here; a missing key file raises it
    when a link first needs it (``Binder.bind``, ``connect``).
    """

    allow_remote_bind: bool = setting(
        False,
        "--allow-remote-bind",
        "allow binding addresses other hosts can reach (not ipc:// or loopback tcp://); use "
        "with --curve-keys-dir",
        switch=True,
        default_text="only those",
    )
    curve_keys_dir: Path | None = setting(
        None,
        "--curve-keys-dir",
        "authenticate and encrypt internal ZeroMQ traffic with the CURVE keys in DIR (made by "
        "`switchyard keygen`)",
        parse=lambda value: Path(value).expanduser(),
        env_default=envs.curve_keys_dir,
        metavar="DIR",
        default_text=f"${envs.CURVE_KEYS_DIR_VARIABLE}, else off",
    )

    def __post_init__(self) -> None:
        if self.curve_keys_dir is not None and not self.curve_keys_dir.is_dir():
            raise ValueError(
                f"CURVE key directory {self.curve_keys_dir} does not exist; "
                "create one with `switchyard keygen --output DIR`"
            )

    @property
    def uses_curve(self) -> bool:
        return self.curve_keys_dir is not None

    def binder(self, context: zmq.Context) -> Binder:
        """The binding side for sockets of ``context`` (starts the authenticator with CURVE)."""
        return Binder(self, context)

    def connect(self, socket: zmq.Socket, address: str, link: Link) -> None:
        """Enable heartbeats and, with CURVE, ``link``'s keys (the server's public key, the
        client role's pair); then connect ``socket``."""
        _prepare(socket, address)
        if self.curve_keys_dir is not None:
            socket.curve_serverkey = public_key(self.curve_keys_dir, link.server)
            socket.curve_publickey, socket.curve_secretkey = key_pair(
                self.curve_keys_dir, link.client
            )
        socket.connect(address)


class Binder:
    """Binds the sockets of one ZeroMQ context under a ``TransportSecurity``.

    With CURVE it owns a ZAP authenticator thread on that context, started here (before any
    socket is bound, so no client can slip in unauthenticated) and stopped by ``close()``, which
    the owner calls after closing its sockets and before ``context.term()`` (term would wait for
    the authenticator's sockets). Each socket's link is its ZAP domain, and each domain has its
    own allowlist: the public key of the link's client role. Also a context manager.
    """

    def __init__(self, security: TransportSecurity, context: zmq.Context) -> None:
        self.security = security
        self._context = context
        self._authenticator: ThreadAuthenticator | None = None
        if security.curve_keys_dir is not None:
            self._authenticator = ThreadAuthenticator(context)
            self._authenticator.start()

    def bind(self, socket: zmq.Socket, address: str, link: Link) -> None:
        """Check ``address``, enable heartbeats and, with CURVE, ``link``'s server keys and
        allowlist (``ValueError`` for a key file that is missing); then bind."""
        check_bind_address(address, self.security.allow_remote_bind)
        keys_dir = self.security.curve_keys_dir
        if keys_dir is not None and self._authenticator is not None:
            if socket.context.underlying != self._context.underlying:
                raise ValueError("the socket belongs to another context than this Binder's")
            server_keys = key_pair(keys_dir, link.server)
            allowed = frozenset({public_key(keys_dir, link.client)})
            self._authenticator.configure_curve_callback(link.name, _AuthorizedKeys(allowed))
            socket.zap_domain = link.name.encode()
            socket.curve_publickey, socket.curve_secretkey = server_keys
            socket.curve_server = True
        elif address.startswith("tcp://") and not is_loopback(_tcp_host(address)):
            logger.warning(
                "binding %s without CURVE keys: ZeroMQ traffic on it is neither "
                "authenticated nor encrypted (see --curve-keys-dir)",
                address,
            )
        _prepare(socket, address)
        socket.bind(address)

    def close(self) -> None:
        """Stop the authenticator, if any. Idempotent."""
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    def __enter__(self) -> Binder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


CONNECTING_FLAGS = ("curve_keys_dir",)
"""The ``TransportSecurity`` fields whose flags a process that only connects takes."""


def add_transport_flags(parser: argparse.ArgumentParser, binds: bool) -> None:
    """Add ``--curve-keys-dir`` and, for a process that binds, ``--allow-remote-bind``."""
    add_flags(parser, TransportSecurity, None if binds else CONNECTING_FLAGS)


def transport_from_args(args: argparse.Namespace) -> TransportSecurity:
    """The ``TransportSecurity`` of flags added by ``add_transport_flags`` (ValueError if bad)."""
    binds = hasattr(args, "allow_remote_bind")
    return from_args(TransportSecurity, args, None if binds else CONNECTING_FLAGS)


class _AuthorizedKeys:
    """ZAP credentials provider of one link: a client may connect iff its public key is in
    the set."""

    def __init__(self, public_keys: frozenset[bytes]) -> None:
        self.public_keys = public_keys

    def callback(self, domain: str, public_key: bytes) -> bool:  # z85-encoded key
        return public_key in self.public_keys


def _prepare(socket: zmq.Socket, address: str) -> None:
    enable_heartbeats(socket)
    if address.startswith("tcp://") and ":" in _tcp_host(address):
        socket.ipv6 = True


def _tcp_host(address: str) -> str:
    """``tcp://HOST:PORT`` → HOST, without the brackets of an IPv6 address."""
    endpoint = address.removeprefix("tcp://")
    if endpoint.startswith("["):
        return endpoint[1:].partition("]")[0]
    return endpoint.rpartition(":")[0] if ":" in endpoint else endpoint


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is localhost or a loopback address
    (127.0.0.0/8, ::1, their IPv4-mapped forms); False for "*", an interface or another
    host name."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
