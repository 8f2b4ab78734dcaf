"""Images in offline prompts, as lmdeploy's VLM pipeline takes them.

A prompt with images is a tuple: ``(text, image)``, ``(text, [images])``, or the same with the
images first. An image is a PIL image, a path to an image file (``str`` or ``os.PathLike``, also
``file:///path``), or a ``data:image/...;base64,`` URL. Remote URLs are not fetched: load the
image first. Each one is bounded as the API server bounds images (``MediaConfig``: how many per
prompt, encoded bytes, decoded pixels), decoded with Pillow (PNG, JPEG, WebP and GIF files) and
preprocessed for the model; its pixels reach the worker through shared memory, as the server's
do. ``ValueError`` says what is wrong with which image.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from PIL import Image

from api_server.config import MediaConfig
from api_server.image_segments import prepared_image
from api_server.images import decode_data_url, decode_image
from api_server.vision import VisionModel
from interfaces.requests import PreparedImage

ImageInput = Image.Image | str | os.PathLike
"""One image of a prompt: a PIL image, a file path, or a data URL."""


def image_prompt(prompt: tuple[Any, ...]) -> tuple[str, list[ImageInput]]:
    """The text and images (in order) of lmdeploy's ``(text, image or [images])`` or ``(image
    or [images], text)``; ``ValueError`` for any other shape."""
    if len(prompt) != 2:
        raise ValueError(
            f"a prompt with images is a (text, image or [images]) tuple, got {len(prompt)} items"
        )
    first, second = prompt
    text, images = (first, second) if isinstance(first, str) else (second, first)
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not isinstance(text, str) or not images:
        raise ValueError("a prompt with images is a (text, image or [images]) tuple")
    return text, images


def check_image_count(num_images: int, vision: VisionModel, media: MediaConfig, room: int) -> None:
    """``ValueError`` for more images than ``max_images_per_prompt``, or than fit in ``room``
    prompt tokens (the context length)."""
    if num_images > media.max_images_per_prompt:
        raise ValueError(
            f"{num_images} images in one prompt; at most {media.max_images_per_prompt} are taken"
        )
    num_tokens = num_images * vision.num_image_tokens
    if num_tokens >= room:
        raise ValueError(
            f"{num_images} images take {num_tokens} prompt tokens ({vision.num_image_tokens} "
            f"each), but the model's context length is {room} tokens"
        )


def prepare_images(
    images: list[ImageInput], vision: VisionModel, media: MediaConfig
) -> list[PreparedImage]:
    """Every image loaded and preprocessed for the model, in order (CPU work: run it off the
    event loop). ``ValueError`` naming the first image that cannot be used."""
    prepared = []
    for position, image in enumerate(images):
        try:
            pixels = vision.preprocess(load_image(image, media))
        except ValueError as error:
            raise ValueError(f"image {position} ({_describe(image)}): {error}") from error
        prepared.append(prepared_image(pixels))
    return prepared


def load_image(image: ImageInput, media: MediaConfig) -> Image.Image:
    """The decoded image; ``ValueError`` saying why it cannot be had."""
    if isinstance(image, Image.Image):
        if image.width < 1 or image.height < 1:  # only made in memory: no file format has one
            raise ValueError("the image has no pixels")
        if image.width * image.height > media.max_image_pixels:
            raise ValueError(f"the image has more than {media.max_image_pixels} pixels")
        try:
            image.load()  # a lazily opened file fails here, not in preprocessing
        except Exception as error:  # Pillow's decoders raise many kinds on corrupt input
            raise ValueError(f"the image cannot be decoded: {error}") from error
        return image
    if not isinstance(image, (str, os.PathLike)):
        raise ValueError(
            f"an image is a PIL image, a file path or a data URL, not {type(image).__name__}"
        )
    source = os.fspath(image)
    scheme = urlsplit(source).scheme.lower() if isinstance(source, str) else ""
    if scheme == "data":
        data = decode_data_url(source, media.max_image_bytes)
    elif scheme == "file":
        data = read_image_file(Path(unquote(urlsplit(source).path)), media.max_image_bytes)
    elif scheme in ("http", "https"):
        raise ValueError("remote images are not fetched offline: load the image and pass it")
    else:
        data = read_image_file(Path(os.fsdecode(source)), media.max_image_bytes)
    return decode_image(data, media.max_image_pixels)


def read_image_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (at most ``max_bytes``); ``ValueError`` for a
    missing, unreadable or larger file, or one that is not a regular file (a FIFO never
    blocks the read)."""
    if not path.exists():
        raise ValueError("the file does not exist")
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ValueError("the path is not a regular file")
            data = file.read(max_bytes + 1)
    except OSError as error:
        raise ValueError(f"the file cannot be read: {error.strerror or error}") from error
    if len(data) > max_bytes:
        raise ValueError(f"the image is larger than {max_bytes} bytes")
    return data


def _describe(image: ImageInput) -> str:
    if isinstance(image, Image.Image):
        return f"a {image.width} x {image.height} PIL image"
    if isinstance(image, (str, os.PathLike)):
        source = os.fspath(image)
        text = source if isinstance(source, str) else os.fsdecode(source)
        return text if len(text) <= 80 else text[:77] + "..."
    return type(image).__name__
