"""A request's image pixels in shared memory, and who unlinks them.

Each image's preprocessed pixels go into a segment of their own (``SharedMemoryArray.create``),
referenced from ``TextContext.images``. The API server owns those segments from their creation
until ``EngineClient.generate`` has sent the request's ``SubmitRequest`` to the scheduler; from
then on the scheduler owns them and unlinks them when the request ends, whatever way it ends.
Every path that ends before the send (a refusal, a failure, a cancelled request) unlinks them
here with ``release_images``. Each choice of an ``n > 1`` request is its own scheduler request
with its own copies (``copy_images``), so each can be unlinked on its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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


def copy_images(images: Sequence[ImageMetadata]) -> list[ImageMetadata]:
    """The same images in new segments of their own (same positions, same hashes), owned by
    the caller; on failure, the copies made so far are unlinked and the originals are kept."""
    copies: list[ImageMetadata] = []
    try:
        for image in images:
            segment = _create(image.pixel_values.read())
            copies.append(ImageMetadata(image.start_idx, image.end_idx, segment, image.image_hash))
    except BaseException:
        release_images(copies)
        raise
    return copies


def release_images(images: Iterable[ImageMetadata]) -> None:
    """Unlink the segments of images the API server still owns (never call it for a request
    the scheduler was sent). Safe to call twice."""
    for image in images:
        image.pixel_values.unlink()
