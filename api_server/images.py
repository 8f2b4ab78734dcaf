"""Images in chat messages: where they may come from, fetching, decoding and preprocessing.

An image part is ``{"type": "image_url", "image_url": {"url": URL, "detail": ...}}`` (``detail``
is accepted and ignored, as vLLM does). URL is one of:

- a data URL, ``data:image/png;base64,...`` (also image/jpeg, image/webp, image/gif);
- ``file:///path``, only when the server runs with ``--allowed-local-media-path DIR`` and the
  path, symlinks resolved, lies inside DIR;
- ``http(s)://host/...``, only when ``--allowed-media-domains`` names the host; fetched with a
  time limit and a size cap, following redirects only on the same host.

Every image is decoded with Pillow (PNG, JPEG, WebP and GIF only; an animated GIF's first
frame) and preprocessed for the model off the event loop. Anything wrong with an image is a
400 (``OpenAIError``) naming its message part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlsplit

import httpx
from PIL import Image, ImageOps

from api_server.config import MediaConfig
from api_server.errors import invalid_request
from api_server.image_segments import prepared_image
from api_server.protocol import ChatMessage
from api_server.vision import VisionModel
from interfaces.requests import PreparedImage

IMAGE_MEDIA_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
}
"""Data URL media types accepted, and the Pillow format of each."""
IMAGE_FORMATS = tuple(IMAGE_MEDIA_TYPES.values())
IDENTITY = {"Accept-Encoding": "identity"}
"""The only formats Pillow is allowed to parse, whatever the source claims."""


@dataclass(frozen=True)
class ImageInput:
    """One image part of a conversation: its URL and where it is in the request."""

    url: str
    param: str
    """``messages[i].content[j]``, for errors about it."""


def image_inputs(messages: list[ChatMessage]) -> list[ImageInput]:
    """The conversation's image parts in prompt order (messages in order, parts in order)."""
    inputs = []
    for index, message in enumerate(messages):
        parts = message.content if isinstance(message.content, list) else []
        for part_index, part in enumerate(parts):
            if part.type == "image_url" and part.image_url is not None:
                param = f"messages[{index}].content[{part_index}]"
                inputs.append(ImageInput(part.image_url.url, param))
    return inputs


def check_images_accepted(
    inputs: list[ImageInput], why_no_images: str | None, model_name: str | None
) -> None:
    """400 naming the first image part when the model takes no images."""
    if inputs and why_no_images is not None:
        param = inputs[0].param
        raise invalid_request(
            f"{param}: content parts of type 'image_url' are not supported by the model "
            f"{model_name!r}: {why_no_images}",
            param=param,
        )


async def load_images(
    inputs: list[ImageInput], media: MediaConfig, vision: VisionModel | None, max_model_len: int
) -> list[PreparedImage]:
    """Fetch, decode and preprocess every image, one after the other, in order. The first
    image that cannot be used is a 400, and so are more images than ``max_images_per_prompt``
    or than fit in ``max_model_len`` tokens (before any is fetched). Creates no shared
    memory."""
    if not inputs or vision is None:
        return []
    if len(inputs) > media.max_images_per_prompt:
        raise invalid_request(
            f"{len(inputs)} images in one request; this server takes at most "
            f"{media.max_images_per_prompt} (--max-images-per-prompt)",
            param="messages",
        )
    num_tokens = len(inputs) * vision.num_image_tokens
    if num_tokens >= max_model_len:
        raise invalid_request(
            f"{len(inputs)} images take {num_tokens} prompt tokens ({vision.num_image_tokens} "
            f"each), but this model's maximum context length is {max_model_len} tokens. "
            "Send fewer images.",
            param="messages",
        )
    prepared = []
    for image in inputs:
        try:
            data = await fetch_image(image.url, media)
            prepared.append(await asyncio.to_thread(_prepare, data, media, vision))
        except ValueError as error:
            raise invalid_request(f"{image.param}: {error}", param=image.param) from error
    return prepared


async def fetch_image(url: str, media: MediaConfig) -> bytes:
    """The encoded image ``url`` names; ``ValueError`` saying why when it cannot be had."""
    scheme = urlsplit(url).scheme.lower()
    if scheme == "data":  # up to tens of MB of base64: off the event loop
        return await asyncio.to_thread(decode_data_url, url, media.max_image_bytes)
    if scheme == "file":
        return await asyncio.to_thread(read_local_file, url, media)
    if scheme in ("http", "https"):
        try:
            return await asyncio.wait_for(fetch_remote(url, media), media.fetch_timeout_s)
        except asyncio.TimeoutError as error:
            raise ValueError(
                f"fetching the image took longer than {media.fetch_timeout_s:g} s"
            ) from error
    raise ValueError(
        "the image URL must be a data: URL, a file:// URL or an http(s):// URL, "
        f"not {scheme or 'a bare path'!r}"
    )


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of ``data:<image type>[;base64],<data>``; ``ValueError`` for another media
    type, bad base64, or more than ``max_bytes``."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ValueError("a data URL needs a ',' before its data")
    media_type, *parameters = (item.strip().lower() for item in header.split(";"))
    if media_type not in IMAGE_MEDIA_TYPES:
        raise ValueError(
            f"data URLs of type {media_type or 'text/plain'!r} are not accepted; "
            f"use one of {', '.join(IMAGE_MEDIA_TYPES)}"
        )
    if "base64" not in parameters:
        data = unquote_to_bytes(payload)
    elif len(payload) > (max_bytes + 2) // 3 * 4 + 4096:  # room for line breaks
        raise ValueError(f"the image is larger than {max_bytes} bytes")
    else:
        payload = "".join(payload.split())
        payload += "=" * (-len(payload) % 4)  # padding is often left out
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"the image's data URL is not valid base64: {error}") from error
    _check_size(len(data), max_bytes)
    return data


def read_local_file(url: str, media: MediaConfig) -> bytes:
    """The file a ``file://`` URL names, when it lies inside ``allowed_local_media_path``
    (after resolving symlinks, so a link cannot lead out); ``ValueError`` otherwise."""
    root = media.allowed_local_media_path
    if root is None:
        raise ValueError(
            "local files are not accepted: the server was started without "
            "--allowed-local-media-path"
        )
    parts = urlsplit(url)
    path = Path(unquote(parts.path))
    if parts.netloc not in ("", "localhost") or not path.is_absolute():
        raise ValueError("a file URL must be file:///absolute/path")
    try:
        resolved = path.resolve()
        if not resolved.is_relative_to(root.resolve()):
            raise ValueError("the file is outside the directory --allowed-local-media-path allows")
        if not resolved.exists():
            raise ValueError("the file does not exist")
        # No symlink swapped in since resolve() is followed, and no FIFO can block the read.
        descriptor = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise ValueError("the file is not a regular file")
            data = file.read(media.max_image_bytes + 1)
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop
        raise ValueError(f"the file cannot be read: {type(error).__name__}") from error
    _check_size(len(data), media.max_image_bytes)
    return data


async def fetch_remote(url: str, media: MediaConfig) -> bytes:
    """GET ``url`` from an allowed host, following at most ``max_redirects`` redirects that
    stay on that host; ``ValueError`` for a refused host, an HTTP error or too many bytes."""
    host = _allowed_host(url, media)
    try:
        async with httpx.AsyncClient(timeout=media.fetch_timeout_s) as client:
            for _ in range(media.max_redirects + 1):
                # Uncompressed, so that the size cap bounds what is held (a gzip bomb cannot
                # inflate past it); a server that compresses anyway sends an undecodable image.
                async with client.stream("GET", url, headers=IDENTITY) as response:
                    if not response.is_redirect:
                        return await _read_body(response, media.max_image_bytes)
                    url = urljoin(url, response.headers.get("location", ""))
                if (urlsplit(url).hostname or "").lower() != host:
                    raise ValueError("the image URL redirects to another host, which is refused")
                _allowed_host(url, media)  # still http(s)
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise ValueError(f"fetching the image failed: {type(error).__name__}: {error}") from error
    raise ValueError(f"the image URL redirects more than {media.max_redirects} times")


def _allowed_host(url: str, media: MediaConfig) -> str:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise ValueError("the image URL is not an http(s) URL with a host")
    if host not in media.allowed_media_domains:
        if not media.allowed_media_domains:
            raise ValueError(
                f"images from {host!r} are refused: the server accepts no remote image URLs "
                "without --allowed-media-domains (send the image as a data URL)"
            )
        raise ValueError(f"images from {host!r} are refused: it is not in --allowed-media-domains")
    return host


async def _read_body(response: httpx.Response, max_bytes: int) -> bytes:
    if response.status_code != 200:
        raise ValueError(f"fetching the image answered HTTP {response.status_code}")
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        _check_size(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        _check_size(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _check_size(num_bytes: int, max_bytes: int) -> None:
    if num_bytes > max_bytes:
        raise ValueError(f"the image is larger than {max_bytes} bytes")


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The decoded image (first frame of an animation), turned upright as its EXIF orientation
    says (as transformers' ``load_image``); ``ValueError`` for anything that is not a complete
    PNG, JPEG, WebP or GIF of at most ``max_pixels`` pixels."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        too_large = image.width * image.height > max_pixels
        if not too_large:
            image.load()
            image = ImageOps.exif_transpose(image)
    except Exception as error:  # Pillow's decoders raise many kinds on corrupt input
        raise ValueError(
            f"the image cannot be decoded (PNG, JPEG, WebP and GIF are accepted): {error}"
        ) from error
    if too_large:
        raise ValueError(f"the image has more than {max_pixels} pixels")
    return image


def _prepare(data: bytes, media: MediaConfig, vision: VisionModel) -> PreparedImage:
    """Runs in a worker thread: decode, preprocess, hash."""
    return prepared_image(vision.preprocess(decode_image(data, media.max_image_pixels)))
