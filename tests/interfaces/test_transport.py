"""The internal sockets' security: bind addresses, CURVE authentication and encryption, flags."""

from __future__ import annotations

import argparse
import os
import select
import shutil
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from interfaces.curve_keys import FILES_BY_PROCESS, Role
from interfaces.transport import (
    BACKEND,
    FRONTEND,
    HEARTBEAT_INTERVAL_MS,
    HEARTBEAT_TIMEOUT_MS,
    HEARTBEAT_TTL_MS,
    KV_TRANSFER,
    Link,
    TransportSecurity,
    add_transport_flags,
    check_bind_address,
    generate_curve_keys,
    transport_from_args,
)
from tests.support.curve_keys import role_keys

WAIT_MS = 5000  # for a message that must arrive
SILENCE_MS = 1000  # for a message that must not (a CURVE handshake on loopback takes ~ms)

LOCAL_ADDRESSES = [
    "ipc:///tmp/switchyard/frontend",
    "inproc://frontend",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:*",
    "tcp://127.1.2.3:5555",
    "tcp://localhost:5555",
    "tcp://[::1]:5555",
]
REMOTE_ADDRESSES = [
    "tcp://0.0.0.0:5555",
    "tcp://*:5555",
    "tcp://[::]:5555",
    "tcp://10.1.2.3:5555",
    "tcp://eth0:5555",
    "tcp://scheduler.example.com:5555",
]


@pytest.mark.parametrize("address", LOCAL_ADDRESSES)
def test_local_addresses_may_be_bound(address: str) -> None:
    assert check_bind_address(address, allow_remote=False) is None


@pytest.mark.parametrize("address", REMOTE_ADDRESSES)
def test_remote_addresses_need_the_flag(address: str) -> None:
    with pytest.raises(ValueError, match="refusing to bind") as error:
        check_bind_address(address, allow_remote=False)
    assert address in str(error.value)
    assert "--allow-remote-bind" in str(error.value)
    assert "--curve-keys-dir" in str(error.value)
    assert check_bind_address(address, allow_remote=True) is None


@pytest.mark.parametrize("address", ["udp://127.0.0.1:5555", "pgm://eth0;239.0.0.1:5555", "x"])
def test_other_transports_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match="ipc://, inproc:// or tcp://"):
        check_bind_address(address, allow_remote=True)


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    generate_curve_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def contexts() -> Iterator[tuple[zmq.Context, zmq.Context]]:
    """A server context and a client context (two processes in production)."""
    server, client = zmq.Context(), zmq.Context()
    yield server, client
    client.destroy(linger=0)
    server.destroy(linger=0)


def new_socket(context: zmq.Context, socket_type: int) -> zmq.Socket:
    sock = context.socket(socket_type)
    sock.linger = 0
    return sock


ROLE_FILES = sorted(f"{role}{suffix}" for role in ("api_server", "kv_transfer", "scheduler",
                    "worker") for suffix in (".key", ".key_secret"))  # fmt: skip


def test_generate_curve_keys(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "keys"
    written = generate_curve_keys(directory)
    assert sorted(path.name for path in directory.iterdir()) == ROLE_FILES
    assert sorted(path.name for path in written) == ROLE_FILES
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for role in Role:
        assert stat.S_IMODE((directory / f"{role.value}.key_secret").stat().st_mode) == 0o600
        public, secret = zmq.auth.load_certificate(directory / f"{role.value}.key_secret")
        assert zmq.auth.load_certificate(directory / f"{role.value}.key") == (public, None)
        assert zmq.curve_public(secret) == public
    publics = {zmq.auth.load_certificate(directory / f"{role.value}.key")[0] for role in Role}
    assert len(publics) == len(Role)  # a key pair per role
    assert sorted({name for names in FILES_BY_PROCESS.values() for name in names}) == ROLE_FILES
    before = (directory / "scheduler.key_secret").read_bytes()
    with pytest.raises(ValueError, match="refusing to overwrite"):
        generate_curve_keys(directory)
    assert (directory / "scheduler.key_secret").read_bytes() == before


def test_secret_files_are_private_from_the_start_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = []
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_CREAT:
            created.append((str(path), flags, mode))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", recording_open)
    old_umask = os.umask(0)
    try:
        generate_curve_keys(tmp_path / "keys")
    finally:
        os.umask(old_umask)
    assert sorted(name for name, _, _ in created) == ROLE_FILES
    for name, flags, mode in created:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW
        assert mode == (0o600 if name.endswith("_secret") else 0o644)
        assert stat.S_IMODE((tmp_path / "keys" / name).stat().st_mode) == mode


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_keygen_refuses_a_directory_others_may_write(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(ValueError, match="writable by its group or by others"):
        generate_curve_keys(directory)
    assert list(directory.iterdir()) == []


def test_keygen_follows_no_symbolic_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ValueError, match="cannot write CURVE keys into"):
        generate_curve_keys(tmp_path / "link")
    assert list(target.iterdir()) == []
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    (directory / "worker.key_secret").symlink_to(victim)  # a dangling link planted in advance
    with pytest.raises(ValueError, match=r"refusing to overwrite .*worker\.key_secret"):
        generate_curve_keys(directory)
    assert not victim.exists() and sorted(p.name for p in directory.iterdir()) == [
        "worker.key_secret"
    ]


def test_keygen_on_the_command_line(tmp_path: Path) -> None:
    from switchyard.cli import main

    assert main(["keygen", "--output", str(tmp_path / "keys")]) == 0
    assert sorted(path.name for path in (tmp_path / "keys").iterdir()) == ROLE_FILES
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    assert main(["keygen", "--output", str(tmp_path / "open")]) == 2


@pytest.mark.parametrize("link", [FRONTEND, BACKEND, KV_TRANSFER], ids=lambda link: link.name)
def test_curve_round_trip(
    link: Link, keys_dir: Path, contexts: tuple[zmq.Context, zmq.Context]
) -> None:
    server_context, client_context = contexts
    security = TransportSecurity(curve_keys_dir=keys_dir)
    with security.binder(server_context) as binder:
        router = new_socket(server_context, zmq.ROUTER)
        binder.bind(router, "tcp://127.0.0.1:*", link)
        dealer = new_socket(client_context, zmq.DEALER)
        security.connect(dealer, router.last_endpoint.decode(), link)
        dealer.send(b"ping")
        assert router.poll(WAIT_MS)
        identity, payload = router.recv_multipart(copy=False)
        assert payload.bytes == b"ping"
        # The ZAP handler authenticated the client: its User-Id is the client role's public key.
        client_public_key = zmq.auth.load_certificate(keys_dir / f"{link.client.value}.key")[0]
        assert payload.get("User-Id") == client_public_key.decode()
        router.send_multipart([identity, b"pong"])
        assert dealer.poll(WAIT_MS)
        assert dealer.recv() == b"pong"
        assert router.curve_server == 1
        for sock in (router, dealer):
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == HEARTBEAT_INTERVAL_MS
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == HEARTBEAT_TIMEOUT_MS
            assert sock.getsockopt(zmq.HEARTBEAT_TTL) == HEARTBEAT_TTL_MS
        router.close()
        dealer.close()


def foreign_client_keys(keys_dir: Path, tmp_path: Path) -> Path:
    """A key directory with the right scheduler public key but an unauthorized API-server
    pair."""
    generate_curve_keys(tmp_path / "foreign")
    directory = tmp_path / "intruder"
    directory.mkdir()
    shutil.copy(keys_dir / "scheduler.key", directory)
    for name in ("api_server.key", "api_server.key_secret"):
        shutil.copy(tmp_path / "foreign" / name, directory)
    return directory


def wrong_server_key(keys_dir: Path, tmp_path: Path) -> Path:
    """The right API-server pair, but trusting another scheduler public key."""
    generate_curve_keys(tmp_path / "other")
    directory = tmp_path / "misled"
    directory.mkdir()
    shutil.copy(tmp_path / "other" / "scheduler.key", directory)
    for name in ("api_server.key", "api_server.key_secret"):
        shutil.copy(keys_dir / name, directory)
    return directory


@pytest.mark.parametrize("client_keys", ["none", "unauthorized", "wrong server key"])
def test_clients_without_authorized_keys_get_nothing_through(
    client_keys: str,
    keys_dir: Path,
    tmp_path: Path,
    contexts: tuple[zmq.Context, zmq.Context],
) -> None:
    server_context, client_context = contexts
    bad_security = {
        "none": lambda: TransportSecurity(),
        "unauthorized": lambda: TransportSecurity(
            curve_keys_dir=foreign_client_keys(keys_dir, tmp_path)
        ),
        "wrong server key": lambda: TransportSecurity(
            curve_keys_dir=wrong_server_key(keys_dir, tmp_path)
        ),
    }[client_keys]()
    security = TransportSecurity(curve_keys_dir=keys_dir)
    with security.binder(server_context) as binder:
        router = new_socket(server_context, zmq.ROUTER)
        binder.bind(router, "tcp://127.0.0.1:*", FRONTEND)
        address = router.last_endpoint.decode()
        intruder = new_socket(client_context, zmq.DEALER)
        bad_security.connect(intruder, address, FRONTEND)
        intruder.send(b"intruder", zmq.NOBLOCK)
        assert router.poll(SILENCE_MS) == 0
        # The same ROUTER still serves an authorized client, and only its message arrives.
        dealer = new_socket(client_context, zmq.DEALER)
        security.connect(dealer, address, FRONTEND)
        dealer.send(b"authorized")
        assert router.poll(WAIT_MS)
        assert router.recv_multipart()[1] == b"authorized"
        assert router.poll(0) == 0
        for sock in (router, intruder, dealer):
            sock.close()


class TcpRelay(threading.Thread):
    """Forwards one TCP connection to ``127.0.0.1:target_port``, keeping every byte it saw."""

    def __init__(self, target_port: int) -> None:
        super().__init__(daemon=True)
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self.stopping = threading.Event()

    def run(self) -> None:
        self.listener.settimeout(WAIT_MS / 1000)
        downstream, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        peer = {downstream: upstream, upstream: downstream}
        with self.listener, downstream, upstream:
            while not self.stopping.is_set():
                readable, _, _ = select.select(list(peer), [], [], 0.05)
                for source in readable:
                    data = source.recv(65536)
                    if not data:
                        return
                    self.seen += data
                    peer[source].sendall(data)


@pytest.mark.parametrize("use_curve", [True, False])
def test_curve_encrypts_the_traffic(
    use_curve: bool, keys_dir: Path, contexts: tuple[zmq.Context, zmq.Context]
) -> None:
    server_context, client_context = contexts
    security = TransportSecurity(curve_keys_dir=keys_dir if use_curve else None)
    marker = b"a prompt nobody else may read"
    with security.binder(server_context) as binder:
        router = new_socket(server_context, zmq.ROUTER)
        binder.bind(router, "tcp://127.0.0.1:*", BACKEND)
        relay = TcpRelay(int(router.last_endpoint.rsplit(b":", 1)[1]))
        relay.start()
        dealer = new_socket(client_context, zmq.DEALER)
        security.connect(dealer, f"tcp://127.0.0.1:{relay.port}", BACKEND)
        dealer.send(marker)
        assert router.poll(WAIT_MS)
        assert router.recv_multipart()[1] == marker
        relay.stopping.set()
        relay.join(WAIT_MS / 1000)
        assert (marker in relay.seen) is not use_curve
        router.close()
        dealer.close()


def test_binder_refuses_remote_addresses(contexts: tuple[zmq.Context, zmq.Context]) -> None:
    server_context, _ = contexts
    with TransportSecurity().binder(server_context) as binder:
        router = new_socket(server_context, zmq.ROUTER)
        with pytest.raises(ValueError, match=r"refusing to bind tcp://0\.0\.0\.0:\*"):
            binder.bind(router, "tcp://0.0.0.0:*", FRONTEND)
        assert router.last_endpoint == b""
        router.close()


def test_missing_keys_are_clear_errors(
    tmp_path: Path, contexts: tuple[zmq.Context, zmq.Context]
) -> None:
    server_context, client_context = contexts
    with pytest.raises(ValueError, match=r"CURVE key directory .*absent does not exist"):
        TransportSecurity(curve_keys_dir=tmp_path / "absent")
    empty = TransportSecurity(curve_keys_dir=tmp_path)
    router = new_socket(server_context, zmq.ROUTER)
    missing_secret = r"cannot read CURVE key file .*scheduler\.key_secret"
    with empty.binder(server_context) as binder, pytest.raises(ValueError, match=missing_secret):
        binder.bind(router, "tcp://127.0.0.1:*", FRONTEND)
    dealer = new_socket(client_context, zmq.DEALER)
    with pytest.raises(ValueError, match=r"cannot read CURVE key file .*scheduler\.key \("):
        empty.connect(dealer, "tcp://127.0.0.1:5555", FRONTEND)
    generate_curve_keys(tmp_path / "keys")
    (tmp_path / "keys" / "api_server.key").unlink()
    (tmp_path / "keys" / "api_server.key_secret").unlink()
    other_context = zmq.Context()  # one Binder per context, as in every process
    other_router = new_socket(other_context, zmq.ROUTER)
    keys = TransportSecurity(curve_keys_dir=tmp_path / "keys")
    missing_public = r"cannot read CURVE key file .*api_server\.key \("
    with keys.binder(other_context) as binder, pytest.raises(ValueError, match=missing_public):
        binder.bind(other_router, "tcp://127.0.0.1:*", FRONTEND)
    other_router.close()
    other_context.term()
    legacy = tmp_path / "legacy"  # the single client pair of older versions
    legacy.mkdir()
    for name in ("scheduler.key", "client.key", "client.key_secret"):
        (legacy / name).write_text("")
    with pytest.raises(ValueError, match="old single client key pair; make one key pair per role"):
        TransportSecurity(curve_keys_dir=legacy).connect(dealer, "tcp://127.0.0.1:5555", BACKEND)
    for sock in (router, dealer):
        sock.close()


@pytest.mark.parametrize(
    ("client_process", "link", "allowed"),
    [
        ("API server", FRONTEND, True),
        ("API server", BACKEND, False),  # an API server's key cannot register as a worker
        ("worker (hybrid, prefill or embedding)", BACKEND, True),
        ("worker (hybrid, prefill or embedding)", FRONTEND, False),
        ("worker (hybrid, prefill or embedding)", KV_TRANSFER, True),
        ("API server", KV_TRANSFER, False),
    ],
)
def test_each_socket_accepts_only_its_client_roles_key(
    client_process: str,
    link: Link,
    allowed: bool,
    keys_dir: Path,
    tmp_path: Path,
    contexts: tuple[zmq.Context, zmq.Context],
) -> None:
    """Each host holds only its own files; a client presents its own role's key pair, as if
    it were the link's client role (a stolen API-server key used against the backend)."""
    server_context, client_context = contexts
    server_process = "decode worker" if link is KV_TRANSFER else "scheduler"
    server_keys = role_keys(keys_dir, tmp_path, server_process)
    client_keys = role_keys(keys_dir, tmp_path, client_process)
    own_role = Role.API_SERVER if client_process == "API server" else Role.WORKER
    if own_role is not link.client:  # the intruder's own pair, under the name link expects
        for suffix in (".key_secret",):
            shutil.copy(client_keys / f"{own_role.value}{suffix}",
                        client_keys / f"{link.client.value}{suffix}")  # fmt: skip
        if link.server is Role.KV_TRANSFER:
            shutil.copy(keys_dir / "kv_transfer.key", client_keys)
    assert not (server_keys / "scheduler.key_secret").exists() or server_process == "scheduler"
    with TransportSecurity(curve_keys_dir=server_keys).binder(server_context) as binder:
        server = new_socket(server_context, zmq.ROUTER)
        binder.bind(server, "tcp://127.0.0.1:*", link)
        client = new_socket(client_context, zmq.DEALER)
        TransportSecurity(curve_keys_dir=client_keys).connect(
            client, server.last_endpoint.decode(), link
        )
        client.send(b"hello", zmq.NOBLOCK)
        assert bool(server.poll(WAIT_MS if allowed else SILENCE_MS)) is allowed
        if allowed:
            assert server.recv_multipart()[1] == b"hello"
        for sock in (server, client):
            sock.close()


def test_transport_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHYARD_CURVE_KEYS_DIR", raising=False)
    parser = argparse.ArgumentParser()
    add_transport_flags(parser, binds=True)
    assert transport_from_args(parser.parse_args([])) == TransportSecurity()
    args = parser.parse_args(["--allow-remote-bind", "--curve-keys-dir", str(tmp_path)])
    assert transport_from_args(args) == TransportSecurity(True, tmp_path)

    monkeypatch.setenv("SWITCHYARD_CURVE_KEYS_DIR", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_transport_flags(parser, binds=False)
    assert transport_from_args(parser.parse_args([])) == TransportSecurity(False, tmp_path)
    with pytest.raises(SystemExit):
        parser.parse_args(["--allow-remote-bind"])
    args = parser.parse_args(["--curve-keys-dir", str(tmp_path / "absent")])
    with pytest.raises(ValueError, match="does not exist"):
        transport_from_args(args)


def test_each_process_takes_the_transport_flags(tmp_path: Path) -> None:
    from api_server.__main__ import parse_args as api_server_args
    from scheduler.__main__ import parse_args as scheduler_args
    from worker.__main__ import parse_args as worker_args

    keys = ["--curve-keys-dir", str(tmp_path)]
    scheduler = scheduler_args(
        ["--frontend-addr", "ipc://a", "--backend-addr", "ipc://b", "--allow-remote-bind", *keys]
    )
    assert transport_from_args(scheduler) == TransportSecurity(True, tmp_path)
    worker = worker_args(["--scheduler-addr", "ipc://b", *keys])
    assert transport_from_args(worker) == TransportSecurity(False, tmp_path)
    api_server = api_server_args(["--model", "m", "--scheduler-addr", "ipc://a", *keys])
    assert transport_from_args(api_server) == TransportSecurity(False, tmp_path)
