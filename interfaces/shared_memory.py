"""SharedMemoryArray: a reference to a NumPy array in POSIX shared memory.

Large arrays (image pixels) never travel inline through ZeroMQ. The producer copies the array
into a named segment and sends this small reference; the consumer maps the segment by name.
The consumer that finishes with the array unlinks the segment, exactly once.

Segments are named ``switchyard_<namespace>_<random hex>``, the namespace being the deployment's
(``interfaces.envs.shm_namespace``), so that an operator, a test, or ``switchyard serve`` after
a crash can find one deployment's segments in /dev/shm (``segment_paths``).

Python registers every segment a process creates or opens with that process's resource tracker,
which unlinks them all when the process exits; ownership here passes between processes
explicitly, so each operation takes its segment back out of the tracker.
"""

from __future__ import annotations

import os
import re
import secrets
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import msgspec
import numpy as np

from interfaces import envs
from interfaces.codec import NUMERIC_DTYPE_KINDS

SEGMENT_PREFIX = "switchyard_"
_SEGMENT_NAME = re.compile(SEGMENT_PREFIX + "[0-9a-f]{8}_[0-9a-f]{24}")
SHM_DIR = Path("/dev/shm")


class SharedMemoryArray(msgspec.Struct, frozen=True, array_like=True):
    """Name, shape and dtype of an array held in a shared-memory segment."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        """Refuse (``msgspec.ValidationError`` when decoding) a reference that could map memory
        as anything but a plain numeric array (no object dtypes, no negative sizes), or name a
        segment ``create`` did not make: whoever unlinks it must not remove another program's."""
        if not _SEGMENT_NAME.fullmatch(self.name):
            raise ValueError(f"not a Switchyard shared-memory segment: {self.name!r}")
        if any(size < 0 for size in self.shape):
            raise ValueError(f"negative size in shape {self.shape}")
        try:
            dtype = np.dtype(self.dtype)
        except (TypeError, ValueError, OverflowError) as error:
            raise ValueError(f"not a dtype: {self.dtype!r}") from error
        if dtype.kind not in NUMERIC_DTYPE_KINDS:
            raise ValueError(f"shared arrays of dtype {dtype} are not accepted")

    @classmethod
    def create(cls, array: np.ndarray) -> SharedMemoryArray:
        """Copy ``array`` into a new segment; the caller hands ownership to the receiver.
        ``OSError`` (and no segment) when shared memory is full."""
        name = f"{SEGMENT_PREFIX}{envs.shm_namespace()}_{secrets.token_hex(12)}"
        size = max(array.nbytes, 1)
        segment = shared_memory.SharedMemory(name, create=True, size=size)
        _untrack(segment)
        try:
            # Reserve the pages now: on a full /dev/shm, writing into a merely truncated segment
            # kills the process with SIGBUS; this raises OSError (ENOSPC) instead.
            os.posix_fallocate(segment._fd, 0, size)
        except OSError:
            segment.close()
            segment.unlink()
            raise
        view = np.ndarray(array.shape, dtype=array.dtype, buffer=segment.buf)
        view[...] = array
        del view  # the segment's buffer cannot close while a view exports it
        segment.close()
        return cls(name=segment.name, shape=tuple(array.shape), dtype=str(array.dtype))

    def read(self) -> np.ndarray:
        """Return a private copy of the array; the segment stays until ``unlink``.
        ``FileNotFoundError`` once it is unlinked."""
        segment = shared_memory.SharedMemory(name=self.name)
        _untrack(segment)
        try:
            view = np.ndarray(self.shape, dtype=np.dtype(self.dtype), buffer=segment.buf)
            array = view.copy()
            del view
            return array
        finally:
            segment.close()

    def unlink(self) -> None:
        """Remove the segment. Safe to call when it is already gone."""
        try:
            segment = shared_memory.SharedMemory(name=self.name)
        except FileNotFoundError:
            return
        segment.close()
        segment.unlink()  # also takes it out of the resource tracker


def segment_paths(namespace: str) -> list[Path]:
    """The segments of deployment ``namespace`` now in /dev/shm (where Linux keeps them)."""
    return sorted(SHM_DIR.glob(f"{SEGMENT_PREFIX}{namespace}_*"))


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Take ``segment`` out of this process's resource tracker (see the module docstring)."""
    resource_tracker.unregister(segment._name, "shared_memory")
