"""A request's image pixels in shared memory, and who unlinks them.

Each image's preprocessed pixels go into a segment of their own (``SharedMemoryArray.create``),
referenced from ``TextContext.images``. The API server owns those segments from their creation
until ``EngineClient.generate`` has sent the request's ``SubmitRequest`` to the scheduler; from
then on the scheduler owns them and unlinks them when the request ends, whatever way it ends.
Every path that ends before the send (a refusal, a failure, a cancelled request) unlinks them
here with ``release_images``.

The choices of an ``n > 1`` request are scheduler requests of their own that name the same
segments (``share_images``; the pixels are never copied). The scheduler unlinks a segment when
the last request naming it has left; here, each choice gives up its hold once, by
``images_sent`` when its ``SubmitRequest`` was sent or ``release_images`` when it never will be,
and the segments are unlinked only by the last choice to let go, and only if none was sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from api_server.errors import service_unavailable
from interfaces import ImageMetadata
from interfaces.shared_memory import SharedMemoryArray


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the model: float32 (channels, height, width) pixels and their hash."""

    pixels: np.ndarray
    image_hash: str

    @classmethod
    def of(cls, pixels: np.ndarray) -> PreparedImage:
        return cls(pixels, pixels_hash(pixels))


def pixels_hash(pixels: np.ndarray) -> str:
    """SHA-256 hex digest over the array's dtype, shape and bytes (the prefix cache's key)."""
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.sha256()
    digest.update(pixels.dtype.str.encode())
    digest.update(repr(tuple(pixels.shape)).encode())
    digest.update(memoryview(pixels).cast("B"))
    return digest.hexdigest()


def create_images(
    images: Sequence[PreparedImage], spans: Sequence[tuple[int, int]]
) -> list[ImageMetadata]:
    """One new segment per image, with its token positions [start, end). The caller owns the
    segments (see the module docstring); if creating one fails, those made so far are
    unlinked before the error propagates."""
    created: list[ImageMetadata] = []
    try:
        for image, (start, end) in zip(images, spans, strict=True):
            segment = _create(image.pixels)
            created.append(ImageMetadata(start, end, segment, image.image_hash))
    except BaseException:
        release_images(created)
        raise
    return created


def _create(pixels: np.ndarray) -> SharedMemoryArray:
    """A new segment holding ``pixels``; 503 when shared memory is full (try again later)."""
    try:
        return SharedMemoryArray.create(pixels)
    except OSError as error:
        raise service_unavailable(
            f"no shared memory left for the image's pixels: {error}"
        ) from error


@dataclass
class _Share:
    """The holds the choices of one request still have on a shared segment."""

    num_holders: int
    sent: bool = field(default=False)


_shares: dict[str, _Share] = {}
"""Shared segments by name, while a choice still holds them (event loop only)."""


def share_images(images: Sequence[ImageMetadata], num_holders: int) -> None:
    """Let ``num_holders`` choices name ``images``, which the caller owns; from now on each of
    them lets go once, by ``images_sent`` or ``release_images``."""
    if num_holders > 1:
        for image in images:
            _shares[image.pixel_values.name] = _Share(num_holders)


def images_sent(images: Iterable[ImageMetadata]) -> None:
    """A choice's ``SubmitRequest`` naming ``images`` was sent: the scheduler owns them now."""
    for image in images:
        share = _shares.get(image.pixel_values.name)
        if share is not None:
            share.sent = True
            _let_go(image.pixel_values.name, share)


def release_images(images: Iterable[ImageMetadata]) -> None:
    """Unlink the segments of images the API server still owns (never call it for a request
    the scheduler was sent). Safe to call twice for images no other choice shares; a shared
    segment counts one hold per call and is unlinked by the last, if no choice was sent."""
    for image in images:
        share = _shares.get(image.pixel_values.name)
        is_ours = share is None or (_let_go(image.pixel_values.name, share) and not share.sent)
        if is_ours:
            image.pixel_values.unlink()


def _let_go(name: str, share: _Share) -> bool:
    """Count one hold off ``share``; whether it was the last."""
    share.num_holders -= 1
    if share.num_holders > 0:
        return False
    del _shares[name]
    return True
