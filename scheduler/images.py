"""The shared-memory pixels of the requests in the scheduler, and their one unlink.

An API server puts each image's pixels in a shared-memory segment and hands the segment to the
scheduler with the request (``ImageMetadata.pixel_values``). From then on the scheduler owns
it: workers only map and copy it (again after a preemption), and the scheduler unlinks it once
the request has left, however it left: finished, refused, aborted by its client, dropped with a
dead API server or worker group, or failed at shutdown, and no step a worker is still running
names it (a worker reads the pixels in the step that brings it the request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from interfaces import RequestID, SharedMemoryArray, TextContext

logger = logging.getLogger(__name__)


class ImageSegments:
    """Segments by request id, for the requests that have images."""

    def __init__(self) -> None:
        self._by_request: dict[RequestID, list[SharedMemoryArray]] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, context: TextContext) -> None:
        """Own the segments of ``context``, a request the scheduler accepted."""
        if context.images:
            self._by_request[context.request_id] = [i.pixel_values for i in context.images]

    def release_departed(self, is_live: Callable[[RequestID], bool]) -> int:
        """Unlink the segments of every request ``is_live`` no longer holds; how many requests'."""
        departed = [request_id for request_id in self._by_request if not is_live(request_id)]
        for request_id in departed:
            _unlink(self._by_request.pop(request_id))
        return len(departed)

    def release_all(self) -> None:
        for segments in self._by_request.values():
            _unlink(segments)
        self._by_request.clear()


def unlink_images(context: TextContext) -> None:
    """Unlink the segments of a request the scheduler refused (never owned by ``ImageSegments``)."""
    _unlink([image.pixel_values for image in context.images])


def _unlink(segments: list[SharedMemoryArray]) -> None:
    for segment in segments:
        try:
            segment.unlink()
        except OSError as error:  # e.g. permissions: log it, never stop the scheduler
            logger.warning("could not unlink shared memory %s: %s", segment.name, error)
