"""msgpack encoding for every message on the wire; NumPy arrays through msgpack-numpy.

There is deliberately no pickle path: a decoder only builds the Struct type it was made for, so a
frame that is garbage, the wrong type, or a pickle payload raises ``msgspec.DecodeError`` /
``msgspec.ValidationError`` and executes nothing.

Arrays are encoded by msgpack-numpy but decoded here: its ``decode`` unpickles any array marked
as an object array (``kind: "O"``), which would let one crafted frame run code. Only plain
numeric arrays whose byte count matches their shape are accepted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack_numpy
import msgspec
import numpy as np

T = TypeVar("T")


def _encode_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return msgpack_numpy.encode(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


NUMERIC_DTYPE_KINDS = frozenset("biuf")
"""dtype kinds allowed on the wire: bool, signed and unsigned integers, floats."""


def _decode_hook(expected: type, obj: Any) -> Any:
    if expected is np.ndarray:
        return decode_array(obj)
    raise NotImplementedError(f"cannot decode objects of type {expected!r}")


def decode_array(obj: Any) -> np.ndarray:
    """The array in a msgpack-numpy map ``{nd: True, type, kind, shape, data}``, read-only.

    Raises ``msgspec.ValidationError`` for anything but a numeric array whose data is exactly
    as long as its shape and dtype say.
    """
    if not isinstance(obj, dict) or obj.get(b"nd") is not True:
        raise msgspec.ValidationError("expected a msgpack-numpy array")
    data, shape, descr = obj.get(b"data"), obj.get(b"shape"), obj.get(b"type")
    if not isinstance(data, bytes) or not isinstance(descr, str):
        raise msgspec.ValidationError("a msgpack-numpy array needs bytes data and a dtype string")
    if not isinstance(shape, (list, tuple)) or not all(
        type(size) is int and size >= 0 for size in shape
    ):
        raise msgspec.ValidationError("a msgpack-numpy array's shape must be non-negative ints")
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError, OverflowError) as error:
        raise msgspec.ValidationError(f"not a dtype: {descr!r}") from error
    if dtype.kind not in NUMERIC_DTYPE_KINDS:
        raise msgspec.ValidationError(f"arrays of dtype {dtype} are not accepted on the wire")
    if math.prod(shape) * dtype.itemsize != len(data):
        raise msgspec.ValidationError(
            f"array data has {len(data)} bytes; shape {list(shape)} of {dtype} needs "
            f"{math.prod(shape) * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def msgpack_numpy_encoder() -> Callable[[Any], bytes]:
    """Return ``encode(obj) -> bytes`` for Structs that may contain NumPy arrays."""
    return msgspec.msgpack.Encoder(enc_hook=_encode_hook).encode


def msgpack_numpy_decoder(type_: type[T]) -> Callable[[bytes], T]:
    """Return ``decode(bytes) -> type_``; raises ``msgspec.DecodeError`` on a bad frame, one
    nested too deeply for the decoder's recursion (free-form fields such as tool parameters
    or a logits processor's args) included."""
    decoder = msgspec.msgpack.Decoder(type_, dec_hook=_decode_hook)

    def decode(frame: bytes) -> T:
        try:
            return decoder.decode(frame)
        except RecursionError:
            raise msgspec.DecodeError("the frame is nested too deeply") from None

    return decode
