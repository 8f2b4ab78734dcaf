"""Frames no peer should ever send to a Switchyard socket, for the tests that send them anyway."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec


class Unpickled:
    """A pickle payload that would create ``path`` if anything ever unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def hostile_frames(marker: Path) -> list[bytes]:
    """Frames no peer should ever send: garbage, pickles, lies about lengths, wrong types."""
    return [
        b"\x00garbage\xff",
        pickle.dumps(Unpickled(marker)),
        b"\xdb\xff\xff\xff\xffabc",  # a str claiming 4 GiB
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion items
        msgspec.msgpack.encode(["submit", [123, "not a token list"]]),
        msgspec.msgpack.encode(["step", "not an int"]),
        msgspec.msgpack.encode({"nd": True, "kind": "O", "data": pickle.dumps(Unpickled(marker))}),
        b"",
    ]
