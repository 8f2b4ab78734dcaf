"""Graceful shutdown of one API server process: the first SIGTERM drains, then stops.

Draining means: new generations and /ready get 503 (so a load balancer or Kubernetes stops
sending traffic here; /health, liveness, stays 200), requests in flight run to their end for up
to ``shutdown_timeout_s``, and whatever is still running then is aborted, each choice ending
with finish reason "abort". Only then does uvicorn close the listening socket and finish. A
second signal stops at once.

A scheduler that refuses this server's protocol version (``EngineClient.refused``) stops it at
once, with exit status 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from api_server.serving import ServerState

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05


async def drain(state: ServerState, timeout_s: float) -> int:
    """Stop taking generations, wait up to ``timeout_s`` for those in flight, abort the rest;
    returns how many were aborted."""
    state.draining = True
    engine = state.engine
    engine.stop_waiting()  # the scheduler may be stopping too: its requests cannot wait for it
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if engine.num_requests_in_flight:
        logger.info("draining %d requests for up to %g s", engine.num_requests_in_flight, timeout_s)
    while engine.num_requests_in_flight and loop.time() < deadline:
        await asyncio.sleep(POLL_INTERVAL_S)
    num_aborted = engine.abort_all()
    if num_aborted:
        logger.warning("shutdown timeout reached; aborted %d requests", num_aborted)
    return num_aborted


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first SIGTERM/SIGINT drains ``app`` before shutting down, and
    which stops, with ``refused`` set (the process then exits 1), when the scheduler refuses the
    app's engine client."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._refusal_task: asyncio.Task[None] | None = None
        self.refused = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        state: ServerState | None = getattr(self._app.state, "server", None)
        if state is not None:
            self._refusal_task = asyncio.ensure_future(self._stop_when_refused(state))

    async def _stop_when_refused(self, state: ServerState) -> None:
        await state.engine.refused()
        self.refused = self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: stop now
            return
        logger.info("received %s; draining before shutdown", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_draining)

    def _start_draining(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            state: ServerState | None = getattr(self._app.state, "server", None)
            if state is not None:
                await drain(state, self._shutdown_timeout_s)
        finally:
            self.should_exit = True
