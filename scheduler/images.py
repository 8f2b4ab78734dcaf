"""The shared-memory pixels of the requests in the scheduler, and their one unlink.

An API server puts each image's pixels in a shared-memory segment and hands the segment to the
scheduler with the request (``ImageMetadata.pixel_values``). From then on the scheduler owns
it: workers only map and copy it (again after a preemption), and the scheduler unlinks it once
the request has left, however it left: finished, refused, aborted by its client, dropped with a
dead API server or worker group, or failed at shutdown, and no step a worker is still running
names it (a worker reads the pixels in the step that brings it the request).

The choices of one ``n > 1`` request are requests of their own that name the same segments, so
a segment is unlinked only once the last request naming it has left. An API server sends all
of a prompt's choices at once; a refused request's segments are therefore unlinked at the next
``release_departed`` (after every message waiting on the socket was handled, so siblings that
arrived with it hold them) rather than at once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from interfaces import RequestID, SharedMemoryArray, TextContext

logger = logging.getLogger(__name__)


class ImageSegments:
    """Segments by request id, for the requests that have images, counted by segment name."""

    def __init__(self) -> None:
        self._by_request: dict[RequestID, list[SharedMemoryArray]] = {}
        self._num_requests: Counter[str] = Counter()
        """How many requests in ``_by_request`` name each segment."""
        self._refused: list[SharedMemoryArray] = []
        """Segments of refused requests, unlinked at the next release unless a request names
        them."""

    def __len__(self) -> int:
        return len(self._by_request) + len(self._refused)

    def add(self, context: TextContext) -> None:
        """Own the segments of ``context``, a request the scheduler accepted."""
        if context.images:
            segments = [image.pixel_values for image in context.images]
            self._by_request[context.request_id] = segments
            self._num_requests.update(segment.name for segment in segments)

    def refuse(self, context: TextContext) -> None:
        """Own the segments of ``context``, a request the scheduler refused: they are unlinked
        at the next ``release_departed`` unless an accepted request names them."""
        self._refused += [image.pixel_values for image in context.images]

    def release_departed(self, is_live: Callable[[RequestID], bool]) -> int:
        """Unlink the segments that no request ``is_live`` holds any more (those of departed
        requests that no other request names, and of refused ones); how many requests left."""
        departed = [request_id for request_id in self._by_request if not is_live(request_id)]
        unused = [segment for segment in self._refused if not self._num_requests[segment.name]]
        self._refused = []
        for request_id in departed:
            for segment in self._by_request.pop(request_id):
                self._num_requests[segment.name] -= 1
                if not self._num_requests[segment.name]:
                    del self._num_requests[segment.name]
                    unused.append(segment)
        _unlink(unused)
        return len(departed)

    def release_all(self) -> None:
        segments = {s.name: s for held in self._by_request.values() for s in held}
        segments.update((segment.name, segment) for segment in self._refused)
        _unlink(list(segments.values()))
        self._by_request.clear()
        self._num_requests.clear()
        self._refused = []


def _unlink(segments: list[SharedMemoryArray]) -> None:
    for segment in segments:
        try:
            segment.unlink()
        except OSError as error:  # e.g. permissions: log it, never stop the scheduler
            logger.warning("could not unlink shared memory %s: %s", segment.name, error)
