"""A request's image pixels in shared memory, and the one object that unlinks them.

Each image's preprocessed pixels go into a segment of their own (``SharedMemoryArray.create``),
referenced from ``TextContext.images``. The API server owns those segments from their creation
until a ``SubmitRequest`` naming them has been sent to the scheduler; from then on the scheduler
owns them and unlinks them when the last request naming them ends, whatever way it ends.

``ImageSegments`` holds the API server's ownership of one context's segments: the choices of an
``n > 1`` request (scheduler requests of their own that name the same segments; the pixels are
never copied) share one. ``EngineClient.generate`` calls ``hand_over`` once a choice's
``SubmitRequest`` was sent; ``close`` (or leaving its ``with`` block), which comes on every
path, unlinks the segments unless they were handed over.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from api_server.errors import service_unavailable
from interfaces import ImageMetadata
from interfaces.requests import PreparedImage
from interfaces.shared_memory import SharedMemoryArray


def prepared_image(pixels: np.ndarray) -> PreparedImage:
    """``pixels`` with their hash, ready for a ``TextGenerationRequest``."""
    return PreparedImage(pixels, pixels_hash(pixels))


def pixels_hash(pixels: np.ndarray) -> str:
    """SHA-256 hex digest over the array's dtype, shape and bytes (the prefix cache's key)."""
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.sha256()
    digest.update(pixels.dtype.str.encode())
    digest.update(repr(tuple(pixels.shape)).encode())
    digest.update(memoryview(pixels).cast("B"))
    return digest.hexdigest()


class ImageSegments:
    """The API server's ownership of one context's image segments (event loop only).

    ``create`` makes them; ``hand_over`` says a ``SubmitRequest`` naming them was sent, so the
    scheduler unlinks them; ``close`` unlinks them unless they were handed over, and may be
    called any number of times. An owner with no images does nothing.
    """

    def __init__(self) -> None:
        self.images: list[ImageMetadata] = []
        self._handed_over = False

    def __enter__(self) -> ImageSegments:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        self.close()

    def create(
        self, images: Sequence[PreparedImage], spans: Sequence[tuple[int, int]]
    ) -> list[ImageMetadata]:
        """One new segment per image, with its token positions [start, end), owned here (if
        creating one fails, those made so far stay here to be closed)."""
        for image, (start, end) in zip(images, spans, strict=True):
            segment = _create(image.pixels)
            self.images.append(ImageMetadata(start, end, segment, image.image_hash))
        return list(self.images)

    def hand_over(self) -> None:
        """A ``SubmitRequest`` naming the segments was sent: they are the scheduler's now."""
        self._handed_over = True

    def close(self) -> None:
        """Unlink the segments unless they were handed over; this owner holds none after."""
        if not self._handed_over:
            for image in self.images:
                image.pixel_values.unlink()
        self.images = []


def _create(pixels: np.ndarray) -> SharedMemoryArray:
    """A new segment holding ``pixels``; 503 when shared memory is full (try again later)."""
    try:
        return SharedMemoryArray.create(pixels)
    except OSError as error:
        raise service_unavailable(
            f"no shared memory left for the image's pixels: {error}"
        ) from error
