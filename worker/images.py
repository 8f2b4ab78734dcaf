"""A vision-language request's images on the worker: pixels read once, features computed once,
and spliced into the input embeddings of exactly the positions each step computes.

The API server puts each image's preprocessed pixels in a ``SharedMemoryArray`` and expands its
placeholder into ``num_image_tokens`` image tokens at positions [start_idx, end_idx); the
scheduler unlinks the segment when the request ends. The worker only reads it, never unlinks it:
when the request arrives (again after a preemption), for each image whose positions are not all
behind a prefix-cache hit. A segment that is gone means the request ended meanwhile; like a
malformed image, that refuses the request alone (``ValueError`` from ``read_images``). An
image's features are computed the first time a step reaches one of its positions, together with
the other images first reached in that step, and stay with the request's state until it is
released, so a chunk boundary inside an image needs no second pass through the vision tower.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from interfaces import ImageMetadata, TextContext
from worker.models.config import VisionConfig

if TYPE_CHECKING:
    from worker.models.loader import Model


@dataclass
class RequestImage:
    """One image of a request: its prompt positions [``start``, ``end``), its ``pixels``
    (channels, height, width) until they are encoded (None also when no position is left to
    compute), then its ``features`` (end - start, hidden_size) until its last position is
    computed."""

    start: int
    end: int
    pixels: torch.Tensor | None
    features: torch.Tensor | None = None


def read_images(
    context: TextContext, vision: VisionConfig | None, num_computed_tokens: int
) -> list[RequestImage]:
    """The request's images, checked against its prompt and the model, with the pixels of each
    one that still has positions at or past ``num_computed_tokens``.

    Raises ``ValueError`` with the reason to refuse the request: images for a model that reads
    none, image tokens that are not exactly at the images' positions, pixels of the wrong shape,
    or a segment that cannot be read (gone: the request was aborted meanwhile).
    """
    if vision is not None:
        _check_image_positions(context.prompt_token_ids, context.images, vision)
    elif context.images:
        raise ValueError("this model does not take images")
    images = []
    for index, image in enumerate(context.images):
        expected = (vision.num_channels, vision.image_size, vision.image_size)
        if tuple(image.pixel_values.shape) != expected:
            raise ValueError(
                f"image {index} has pixels of shape {tuple(image.pixel_values.shape)}; "
                f"this model takes {expected}"
            )
        needed = image.end_idx > num_computed_tokens
        pixels = _read_pixels(image, index) if needed else None
        images.append(RequestImage(image.start_idx, image.end_idx, pixels))
    return images


def input_embeddings(
    model: Model,
    input_ids: Sequence[int],
    images: Sequence[Sequence[RequestImage]],
    num_computed_tokens: Sequence[int],
    counts: Sequence[int],
) -> torch.Tensor | None:
    """The step's input embeddings (num_tokens, hidden_size) for ``input_ids``, the requests'
    scheduled tokens in batch order, with image features at the image positions the step
    computes; None when it computes none (the model then embeds ``input_ids`` itself).

    Per request, in batch order: its ``images`` (``RequestState.images``), how many of its
    tokens were computed before this step and how many the step computes."""
    spans = list(_image_spans(images, num_computed_tokens, counts))
    if not spans:
        return None
    _encode([image for _, image, _, _ in spans if image.features is None], model)
    device = next(model.parameters()).device
    embeddings = model.embed(torch.tensor(input_ids, dtype=torch.int64, device=device))
    # (num_tokens, hidden_size)
    for row, image, first, last in spans:
        rows = image.features[first - image.start : last - image.start]
        embeddings[row : row + last - first] = rows.to(embeddings.dtype)
        if last == image.end:
            image.features = None  # every position is computed: the KV cache holds the rest
    return embeddings


def _image_spans(
    images: Sequence[Sequence[RequestImage]],
    num_computed_tokens: Sequence[int],
    counts: Sequence[int],
) -> Iterator[tuple[int, RequestImage, int, int]]:
    """(first batch row, image, first position, end position) for each image's positions in
    the step: those in [num_computed_tokens, num_computed_tokens + count) of its request."""
    row = 0
    for request_images, start, count in zip(images, num_computed_tokens, counts, strict=True):
        end = start + count
        for image in request_images:
            first, last = max(start, image.start), min(end, image.end)
            if first < last:
                yield row + first - start, image, first, last
        row += count


def _encode(images: list[RequestImage], model: Model) -> None:
    """Compute ``images``' features in one pass through the vision tower; drop their pixels."""
    if not images:
        return
    if any(image.pixels is None for image in images):
        raise RuntimeError("an image's positions are scheduled but its pixels were never read")
    pixels = torch.stack([image.pixels for image in images])  # (num_images, channels, h, w)
    features = model.image_features(pixels)  # (num_images, num_image_tokens, hidden_size)
    for image, rows in zip(images, features, strict=True):
        image.features, image.pixels = rows, None


def _check_image_positions(
    prompt_token_ids: Sequence[int], images: Sequence[ImageMetadata], vision: VisionConfig
) -> None:
    """Each image covers ``num_image_tokens`` image tokens, in prompt order, without overlap,
    and the prompt has no image token elsewhere."""
    is_image_token = np.asarray(prompt_token_ids) == vision.image_token_id
    previous_end = 0
    for index, image in enumerate(images):
        start, end = image.start_idx, image.end_idx
        if not previous_end <= start <= end <= len(prompt_token_ids):
            raise ValueError(
                f"image {index} at positions [{start}, {end}) is out of prompt order or past "
                f"its {len(prompt_token_ids)} tokens"
            )
        if end - start != vision.num_image_tokens:
            raise ValueError(
                f"image {index} has {end - start} image tokens; this model takes "
                f"{vision.num_image_tokens} per image"
            )
        if not is_image_token[start:end].all():
            raise ValueError(f"image {index}'s positions [{start}, {end}) are not image tokens")
        previous_end = end
    if int(is_image_token.sum()) != len(images) * vision.num_image_tokens:
        raise ValueError("the prompt has image tokens outside its images' positions")


def _read_pixels(image: ImageMetadata, index: int) -> torch.Tensor:
    """A private copy of the image's pixels (the segment stays: the scheduler unlinks it)."""
    try:
        return torch.from_numpy(image.pixel_values.read())
    except FileNotFoundError as error:
        raise ValueError(
            f"image {index}'s pixels are not in this host's shared memory (the request ended, "
            "or this worker runs on another host than the API server)"
        ) from error
    except (OSError, TypeError, ValueError) as error:  # a segment smaller than its shape
        raise ValueError(f"image {index}'s pixels cannot be read: {error}") from error
