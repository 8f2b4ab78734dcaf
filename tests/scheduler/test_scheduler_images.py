"""scheduler.images: a segment that several requests name (the choices of an n > 1 request)
is unlinked once, when the last of them has left; a refused request's segments wait for the
next release, so siblings that arrived with it keep them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from interfaces import ImageMetadata, SharedMemoryArray, TextContext
from scheduler.images import ImageSegments


def choice(request_id: str, segment: SharedMemoryArray) -> TextContext:
    image = ImageMetadata(0, 1, segment, image_hash="h")
    context = TextContext(request_id=request_id, prompt_token_ids=[1, 2], max_length=8)
    return msgspec.structs.replace(context, images=[image])


def exists(segment: SharedMemoryArray) -> bool:
    return Path("/dev/shm", segment.name).exists()


def test_a_shared_segment_is_unlinked_when_the_last_request_naming_it_leaves() -> None:
    shared = SharedMemoryArray.create(np.ones((3, 2, 2), np.float32))
    own = SharedMemoryArray.create(np.zeros((3, 2, 2), np.float32))
    segments = ImageSegments()
    for request_id in ("c-0", "c-1", "c-2"):
        segments.add(choice(request_id, shared))
    segments.add(choice("other", own))
    live = {"c-1", "c-2", "other"}
    assert segments.release_departed(live.__contains__) == 1
    assert exists(shared) and exists(own)
    live = {"c-2"}
    assert segments.release_departed(live.__contains__) == 2
    assert exists(shared) and not exists(own)
    assert segments.release_departed(set().__contains__) == 1
    assert not exists(shared) and len(segments) == 0


def test_a_refused_requests_segment_stays_for_a_sibling_that_arrived_with_it() -> None:
    shared = SharedMemoryArray.create(np.ones((3, 2, 2), np.float32))
    alone = SharedMemoryArray.create(np.zeros((3, 2, 2), np.float32))
    segments = ImageSegments()
    segments.refuse(choice("c-0", shared))  # e.g. the queue was full for the first choice
    segments.add(choice("c-1", shared))  # handled in the same drain of the socket
    segments.refuse(choice("lonely", alone))
    assert len(segments) == 3 and exists(shared) and exists(alone)
    assert segments.release_departed({"c-1"}.__contains__) == 0
    assert exists(shared) and not exists(alone)
    assert segments.release_departed(set().__contains__) == 1
    assert not exists(shared) and len(segments) == 0


def test_release_all_unlinks_every_segment_once() -> None:
    shared = SharedMemoryArray.create(np.ones((3, 2, 2), np.float32))
    refused = SharedMemoryArray.create(np.zeros((3, 2, 2), np.float32))
    segments = ImageSegments()
    segments.add(choice("c-0", shared))
    segments.add(choice("c-1", shared))
    segments.refuse(choice("r", refused))
    segments.release_all()
    assert not exists(shared) and not exists(refused) and len(segments) == 0
