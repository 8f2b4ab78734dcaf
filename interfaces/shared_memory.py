"""SharedMemoryArray: a reference to a NumPy array in POSIX shared memory.

Large arrays (image pixels) never travel inline through ZeroMQ. The producer copies the array
into a named segment and sends this small reference; the consumer maps the segment by name.
The consumer that finishes with the array unlinks the segment, exactly once.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import msgspec
import numpy as np

from interfaces.codec import NUMERIC_DTYPE_KINDS


class SharedMemoryArray(msgspec.Struct, frozen=True, array_like=True):
    """Name, shape and dtype of an array held in a shared-memory segment."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        """Refuse (``msgspec.ValidationError`` when decoding) a reference that could map memory
        as anything but a plain numeric array: no object dtypes, no negative sizes."""
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
        """Copy ``array`` into a new segment; the caller hands ownership to the receiver."""
        segment = shared_memory.SharedMemory(create=True, size=max(array.nbytes, 1))
        view = np.ndarray(array.shape, dtype=array.dtype, buffer=segment.buf)
        view[...] = array
        segment.close()
        return cls(name=segment.name, shape=tuple(array.shape), dtype=str(array.dtype))

    def read(self) -> np.ndarray:
        """Return a private copy of the array; the segment stays until ``unlink``."""
        segment = shared_memory.SharedMemory(name=self.name)
        try:
            view = np.ndarray(self.shape, dtype=np.dtype(self.dtype), buffer=segment.buf)
            return view.copy()
        finally:
            segment.close()

    def unlink(self) -> None:
        """Remove the segment. Safe to call when it is already gone."""
        try:
            segment = shared_memory.SharedMemory(name=self.name)
        except FileNotFoundError:
            return
        segment.close()
        segment.unlink()
