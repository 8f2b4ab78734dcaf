"""The Responses API's store: responses kept for ``GET /v1/responses/{id}`` and for
``previous_response_id``, in one SQLite database that every API server process of a deployment
shares and that outlives them.

The database is ``responses.sqlite3`` in ``--responses-store-dir`` (default: the cache
directory's ``responses``), in WAL mode, so that several processes read while one writes, with a
busy timeout for writers that meet each other. A row holds a response as returned and the
conversation that led to it (input items, ``instructions`` excluded): enough for the next
request to continue it on any API server. The store is bounded by age (rows older than
``--responses-store-max-age-days`` are neither returned nor kept) and by size (the oldest rows
go first once the rows take more than ``--responses-store-max-mb``); each write evicts.

The database is opened on first use, so a server that never stores a response never touches
the directory, and a directory that cannot be used (not writable, a corrupt database) fails the
requests that need the store with a 503 naming it (``StoreUnavailable``), never the process; the
next such request tries again. SQLite calls block: ``ResponseStore`` runs every one in a thread
of its own, one at a time per process.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from interfaces import envs
from interfaces.settings import setting

DATABASE_NAME = "responses.sqlite3"
BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another process's write to finish before it fails."""
MAX_ROW_BYTES = 64 * 1024 * 1024
"""A stored response and its conversation take at most this (or the store's size, if smaller);
a row read back that claims more is refused as corrupt."""
SECONDS_PER_DAY = 24 * 60 * 60
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    num_bytes INTEGER NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


def positive_number(text: str) -> float:
    """argparse type: a number above 0."""
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def absolute_directory(value: str | None) -> str | None:
    """``--responses-store-dir`` as an absolute path (None: unset), so every process that is
    handed it names the same directory."""
    return None if value is None else str(Path(value).expanduser().absolute())


@dataclass(frozen=True)
class ResponseStoreConfig:
    """Where the Responses API keeps stored responses, and for how long."""

    directory: str | None = setting(
        None,
        "--responses-store-dir",
        "keep stored Responses API responses in DIR/responses.sqlite3; every API server of a "
        "deployment must be given the same DIR so a conversation continues on any of them",
        to_field=absolute_directory,
        metavar="DIR",
        default_text="$SWITCHYARD_CACHE_DIR/responses, else ~/.cache/switchyard/responses",
    )
    max_age_days: float = setting(
        30.0,
        "--responses-store-max-age-days",
        "forget stored responses older than this many days",
        parse=positive_number,
        metavar="DAYS",
    )
    max_mb: float = setting(
        1024.0,
        "--responses-store-max-mb",
        "keep stored responses within this many MiB, forgetting the oldest first",
        parse=positive_number,
        metavar="MIB",
    )

    def __post_init__(self) -> None:
        for name in ("max_age_days", "max_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number above 0, got {value!r}")

    @property
    def path(self) -> Path:
        """The database file (the directory by default under ``envs.cache_dir()``)."""
        directory = envs.cache_dir() / "responses" if self.directory is None else self.directory
        return Path(directory).expanduser() / DATABASE_NAME

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * 1024 * 1024)

    @property
    def max_row_bytes(self) -> int:
        return min(MAX_ROW_BYTES, self.max_bytes)


class StoreUnavailable(Exception):
    """The store cannot serve this request (the message says why, for the user)."""


@dataclass(frozen=True)
class StoredResponse:
    """One row as read back: the response object and the conversation before its output, both
    as JSON text that the caller validates."""

    response: str
    conversation: str


class ResponseStore:
    """The store of one API server process (see the module docstring). ``clock`` gives the
    time in seconds since the epoch (tests move it)."""

    def __init__(self, config: ResponseStoreConfig, clock=time.time) -> None:
        self.config = config
        self.clock = clock
        self._connection: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="response-store")
        """Its own thread: requests that wait for the store hold no thread that others need."""

    async def put(self, response_id: str, response: str, conversation: str) -> None:
        """Store a response (replacing one of the same id), then evict what is too old or
        over the size bound."""
        await self._run(self._put, response_id, response, conversation)

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None if there is none (or it has expired)."""
        return await self._run(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        """Forget a response; False if there was none."""
        return await self._run(self._delete, response_id)

    async def check(self) -> None:
        """Open the database if it is not yet open: ``StoreUnavailable`` if it cannot be."""
        await self._run(lambda connection: None)

    def check_row_size(self, num_bytes: int) -> bool:
        """Whether a row of ``num_bytes`` fits."""
        return num_bytes <= self.config.max_row_bytes

    def close(self) -> None:
        """Close the database and the store's thread (the store is not used after)."""
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
        self._thread.shutdown(wait=False)

    async def _run(self, operation, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._locked, operation, *args)

    def _locked(self, operation, *args):
        with self._lock:
            try:
                connection = self._open()
                with connection:  # one transaction: committed, or rolled back on an error
                    return operation(connection, *args)
            except (sqlite3.Error, OSError) as error:
                self._drop_connection()
                raise StoreUnavailable(
                    f"the response store {self.config.path} cannot be used: {error}"
                ) from error

    def _open(self) -> sqlite3.Connection:
        if self._connection is not None:
            return self._connection
        path = self.config.path
        path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None
        )
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.executescript(_SCHEMA)
            connection.execute("SELECT count(*) FROM responses").fetchone()
        except BaseException:
            connection.close()
            raise
        connection.isolation_level = "DEFERRED"
        self._connection = connection
        return connection

    def _drop_connection(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _put(
        self, connection: sqlite3.Connection, response_id: str, response: str, conversation: str
    ) -> None:
        num_bytes = len(response.encode()) + len(conversation.encode())
        if not self.check_row_size(num_bytes):
            raise sqlite3.DataError(
                f"the response takes {num_bytes} bytes, more than a row may "
                f"({self.config.max_row_bytes}; --responses-store-max-mb)"
            )
        connection.execute(
            "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
            (response_id, self.clock(), num_bytes, response, conversation),
        )
        self._evict(connection)

    def _evict(self, connection: sqlite3.Connection) -> None:
        """Drop the expired rows, then the oldest until the rest fit in ``max_bytes``."""
        connection.execute("DELETE FROM responses WHERE created_at < ?", (self._oldest_kept(),))
        (total,) = connection.execute("SELECT total(num_bytes) FROM responses").fetchone()
        excess = total - self.config.max_bytes
        if excess <= 0:
            return
        doomed = []
        for response_id, num_bytes in connection.execute(
            "SELECT id, num_bytes FROM responses ORDER BY created_at, id"
        ):
            doomed.append((response_id,))
            excess -= num_bytes
            if excess <= 0:
                break
        connection.executemany("DELETE FROM responses WHERE id = ?", doomed)

    def _get(self, connection: sqlite3.Connection, response_id: str) -> StoredResponse | None:
        row = connection.execute(
            "SELECT num_bytes, length(CAST(response AS BLOB)) + length(CAST(conversation AS BLOB))"
            " FROM responses WHERE id = ? AND created_at >= ?",
            (response_id, self._oldest_kept()),
        ).fetchone()
        if row is None:
            return None
        if not isinstance(row[1], int) or row[1] > MAX_ROW_BYTES:
            raise sqlite3.DataError(f"the stored response {response_id} is malformed")
        row = connection.execute(
            "SELECT response, conversation FROM responses WHERE id = ?", (response_id,)
        ).fetchone()
        if row is None:  # deleted or evicted by another process between the two reads
            return None
        response, conversation = row
        if not isinstance(response, str) or not isinstance(conversation, str):
            raise sqlite3.DataError(f"the stored response {response_id} is malformed")
        return StoredResponse(response, conversation)

    def _delete(self, connection: sqlite3.Connection, response_id: str) -> bool:
        cursor = connection.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cursor.rowcount > 0

    def _oldest_kept(self) -> float:
        return self.clock() - self.config.max_age_days * SECONDS_PER_DAY
