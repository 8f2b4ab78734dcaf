"""CURVE key files: one key pair per role, and which socket accepts which role's key.

``switchyard keygen --output DIR`` (``generate_curve_keys``) writes a key pair for each role
into DIR, as ZeroMQ certificate files: ``ROLE.key`` holds the public key, ``ROLE.key_secret``
the public and the secret key (mode 0600 from the moment it exists). Every internal connection
is a ``Link``: a server role binds with its secret key and accepts only the public key of the
one client role that link is for, so an API server's key cannot register a worker, and a decode
worker binds its KV-transfer socket with a key pair of its own rather than the scheduler's.
``FILES_BY_PROCESS`` says which files each process needs; one directory holding them all (the
``--curve-keys-dir`` of every role on one host) works everywhere.
"""

from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

_Z85_KEY_LENGTH = 40
_LEGACY_CLIENT_KEY = "client.key_secret"


class Role(enum.Enum):
    """Whose key pair: the stem of its two files."""

    SCHEDULER = "scheduler"
    API_SERVER = "api_server"
    WORKER = "worker"
    KV_TRANSFER = "kv_transfer"
    """The key pair a decode worker binds its KV-transfer socket with."""


@dataclass(frozen=True)
class Link:
    """One kind of internal connection: ``server`` binds (with its key pair) and accepts only
    ``client``'s public key. ``name`` is its ZAP domain."""

    name: str
    server: Role
    client: Role


FRONTEND = Link("frontend", Role.SCHEDULER, Role.API_SERVER)
"""API servers → the scheduler's frontend ROUTER."""
BACKEND = Link("backend", Role.SCHEDULER, Role.WORKER)
"""Workers → the scheduler's backend ROUTER."""
KV_TRANSFER = Link("kv_transfer", Role.KV_TRANSFER, Role.WORKER)
"""Prefill workers → a decode worker's KV-transfer PULL socket."""

FILES_BY_PROCESS: dict[str, tuple[str, ...]] = {
    "scheduler": ("scheduler.key_secret", "api_server.key", "worker.key"),
    "API server": ("scheduler.key", "api_server.key_secret"),
    "worker (hybrid, prefill or embedding)": (
        "scheduler.key",
        "worker.key_secret",
        "kv_transfer.key",  # a prefill worker's: the decode workers' public key
    ),
    "decode worker": ("scheduler.key", "worker.key_secret", "kv_transfer.key_secret"),
}
"""The key files each process reads from its ``--curve-keys-dir``."""

_BANNER = (
    "#   ZeroMQ CURVE {kind} certificate for Switchyard's {role} role (`switchyard keygen`)\n"
    "#   {advice}\n\n"
)


def public_key(directory: Path, role: Role) -> bytes:
    """``role``'s z85 public key, from ``ROLE.key`` (or, where only that is present, from
    ``ROLE.key_secret``, which holds it too); ``ValueError`` if missing or bad."""
    name = f"{role.value}.key"
    if not (directory / name).exists() and (directory / f"{name}_secret").exists():
        name += "_secret"
    return _read(directory, name)[0]


def key_pair(directory: Path, role: Role) -> tuple[bytes, bytes]:
    """``role``'s z85 (public, secret) keys, from ``ROLE.key_secret`` (``ValueError``)."""
    public, secret = _read(directory, f"{role.value}.key_secret")
    if secret is None:
        raise ValueError(f"CURVE key file {directory / f'{role.value}.key_secret'} holds no secret")
    return public, secret


def _read(directory: Path, name: str) -> tuple[bytes, bytes | None]:
    path = directory / name
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        advice = "create the key directory with `switchyard keygen --output DIR`"
        if (directory / _LEGACY_CLIENT_KEY).exists():
            advice = (
                "this directory holds the old single client key pair; make one key pair per "
                "role with `switchyard keygen --output NEW_DIR`"
            )
        raise ValueError(f"cannot read CURVE key file {path} ({error}); {advice}") from None
    if any(key is not None and len(key) != _Z85_KEY_LENGTH for key in (public, secret)):
        raise ValueError(f"CURVE key file {path} holds a malformed key")
    return public, secret


def generate_curve_keys(directory: Path) -> list[Path]:
    """Write a key pair for every ``Role`` into ``directory``; returns the files written.

    The directory is created (mode 0700) if it does not exist. ``ValueError``, before anything
    is written, if it is a symbolic link, not a directory, not this user's, writable by its
    group or by others, or already holds one of the files. Files are created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the opened directory: secret files with mode
    0600 (public ones 0644) from the moment they exist, never through a link, never over a
    file already there.
    """
    if not os.path.lexists(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(directory, 0o700)
    try:
        directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise ValueError(f"cannot write CURVE keys into {directory}: {error.strerror}") from None
    try:
        _check_private(directory, os.fstat(directory_fd))
        names = [f"{role.value}{suffix}" for role in Role for suffix in (".key", ".key_secret")]
        existing = [name for name in names if _exists(name, directory_fd)]
        if existing:
            raise ValueError(f"refusing to overwrite CURVE keys in {directory}: {existing}")
        for role in Role:
            public, secret = zmq.curve_keypair()
            stem = role.value
            _write(directory_fd, f"{stem}.key", 0o644, _certificate(role, public, None))
            _write(directory_fd, f"{stem}.key_secret", 0o600, _certificate(role, public, secret))
    finally:
        os.close(directory_fd)
    return [directory / name for name in names]


def _check_private(directory: Path, status: os.stat_result) -> None:
    if status.st_uid != os.geteuid():
        raise ValueError(f"refusing to write CURVE keys into {directory}: another user owns it")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"refusing to write CURVE keys into {directory}: it is writable by its group or by "
            "others, who could replace the keys (chmod go-w, or pick a private directory)"
        )


def _exists(name: str, directory_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _certificate(role: Role, public: bytes, secret: bytes | None) -> bytes:
    kind, advice = ("public", "give it to the hosts that talk to this role")
    if secret is not None:
        kind, advice = ("secret", "only the hosts of this role may read this file")
    text = _BANNER.format(kind=kind, role=role.value, advice=advice)
    text += f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    return text.encode()


def _write(directory_fd: int, name: str, mode: int, content: bytes) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        file_fd = os.open(name, flags, mode, dir_fd=directory_fd)
    except OSError as error:
        raise ValueError(f"cannot create CURVE key file {name}: {error.strerror}") from None
    with os.fdopen(file_fd, "wb") as file:
        file.write(content)
