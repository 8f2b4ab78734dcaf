"""msgpack encoding for every message on the wire; NumPy arrays through msgpack-numpy.

There is deliberately no pickle path: a decoder only builds the Struct type it was made for, so a
frame that is garbage, the wrong type, or a pickle payload raises ``msgspec.DecodeError`` /
``msgspec.ValidationError`` and executes nothing.
"""

from __future__ import annotations

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


def _decode_hook(expected: type, obj: Any) -> Any:
    if expected is np.ndarray:
        if not isinstance(obj, dict) or b"nd" not in obj:
            raise msgspec.ValidationError("expected a msgpack-numpy array")
        return msgpack_numpy.decode(obj)
    raise NotImplementedError(f"cannot decode objects of type {expected!r}")


def msgpack_numpy_encoder() -> Callable[[Any], bytes]:
    """Return ``encode(obj) -> bytes`` for Structs that may contain NumPy arrays."""
    return msgspec.msgpack.Encoder(enc_hook=_encode_hook).encode


def msgpack_numpy_decoder(type_: type[T]) -> Callable[[bytes], T]:
    """Return ``decode(bytes) -> type_``; raises ``msgspec.DecodeError`` on a bad frame."""
    return msgspec.msgpack.Decoder(type_, dec_hook=_decode_hook).decode
