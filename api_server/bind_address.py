"""The address an API server listens on: whether it is loopback, and the warning when it is not.

No FastAPI here: ``switchyard serve`` (the launcher) warns too, before it starts API servers.
"""

from __future__ import annotations

import logging
import socket

from interfaces.transport import is_loopback

logger = logging.getLogger(__name__)


def listening_host(host: str, fd: int | None) -> str:
    """The address the server listens on: ``host``, or the inherited listening socket's
    (file descriptor ``fd``, left open) when there is one; "" for a Unix socket."""
    if fd is None:
        return host
    listener = inherited_listener(fd)
    try:
        address = listener.getsockname()
    finally:
        listener.detach()
    return address[0] if isinstance(address, tuple) else ""


def inherited_listener(fd: int) -> socket.socket:
    """The listening socket inherited as file descriptor ``fd``, its family, type and protocol
    read from the descriptor, for ``uvicorn.Server.run(sockets=...)``.

    uvicorn's own ``fd`` option wraps the descriptor as a Unix socket whatever it is, so asyncio
    takes the connections it accepts for Unix ones and never sets TCP_NODELAY on them. Nagle's
    algorithm then holds each small write (a streamed event, a body after its headers) until
    the client acknowledges the one before: up to its delayed-ACK timeout (40 ms on Linux), or
    until the next token's event, which made every stream's first token arrive with its second.
    Accepted through this socket object, TCP connections get TCP_NODELAY, as on a port that
    uvicorn binds itself."""
    return socket.socket(fileno=fd)


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """Log a warning when a server about to listen on ``host`` (not a loopback address) has no
    API key: anyone who can reach the address can use it. Call it once per server started."""
    if api_key or is_loopback(host):
        return
    logger.warning(
        "listening on %s without an API key: anyone who can reach this address can use the "
        "model. Set SWITCHYARD_API_KEY (clients then send 'Authorization: Bearer KEY'), or "
        "listen on 127.0.0.1 behind a proxy that authenticates",
        host,
    )
