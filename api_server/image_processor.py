"""A vision model's image preprocessing in NumPy and Pillow, as transformers' processors do it.

Two pipelines are implemented, read from the model's preprocessor_config.json (or the
"image_processor" object of processor_config.json), with transformers' class defaults for the
keys a file leaves out:

- ``CLIPImageProcessor``: convert to RGB, resize the shortest edge to ``size["shortest_edge"]``
  (the other edge ``int(shortest * long / short)``), center crop to ``crop_size``, rescale,
  normalize;
- ``SiglipImageProcessor``: convert to RGB, resize to ``size["height"]`` x ``size["width"]``,
  rescale, normalize.

The result is float32 (channels, height, width), equal to transformers' PIL ("slow") backend,
which resizes with Pillow too. Its torchvision ("fast") backend resizes differently and may
differ in the last digits. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from api_server.config import read_json

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200
"""Longer edge over shorter edge at most (Qwen2-VL's bound): a shortest-edge resize scales the
long edge up with the short one, so a 1 x 30,000 image would become gigabytes."""

_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
    },
    "SiglipImageProcessor": {
        "size": {"height": 224, "width": 224},
        "do_center_crop": False,
        "image_mean": IMAGENET_STANDARD_MEAN,
        "image_std": IMAGENET_STANDARD_STD,
    },
}
"""transformers' class defaults that differ between the two; the rest are shared below."""
_SHARED_DEFAULTS: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": Image.Resampling.BICUBIC,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
}


@dataclass(frozen=True)
class ImageProcessor:
    """One model's preprocessing. ``resize_to`` is (height, width) for a fixed size, or None
    when ``shortest_edge`` applies; ``crop_to`` is (height, width), or None for no crop."""

    kind: str
    do_convert_rgb: bool
    shortest_edge: int | None
    resize_to: tuple[int, int] | None
    resample: Image.Resampling
    crop_to: tuple[int, int] | None
    rescale_factor: float | None
    image_mean: tuple[float, ...] | None
    image_std: tuple[float, ...] | None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageProcessor:
        """From a preprocessor config; ``ValueError`` for a processor type or size this module
        does not implement."""
        kind = _base_type(str(config.get("image_processor_type", "")))
        if kind not in _DEFAULTS:
            raise ValueError(
                f"image processor {config.get('image_processor_type')!r} is not supported "
                f"(only {' and '.join(_DEFAULTS)})"
            )
        settings = {**_SHARED_DEFAULTS, **_DEFAULTS[kind], **config}
        shortest_edge, resize_to = _resize_target(kind, settings)
        crop_to = _square(settings.get("crop_size")) if settings["do_center_crop"] else None
        if settings["do_center_crop"] and crop_to is None:
            raise ValueError(f"crop_size {settings.get('crop_size')!r} is not supported")
        normalize = bool(settings["do_normalize"])
        return cls(
            kind=kind,
            do_convert_rgb=bool(settings["do_convert_rgb"]),
            shortest_edge=shortest_edge,
            resize_to=resize_to,
            resample=Image.Resampling(int(settings["resample"])),
            crop_to=crop_to,
            rescale_factor=float(settings["rescale_factor"]) if settings["do_rescale"] else None,
            image_mean=tuple(_channels(settings["image_mean"])) if normalize else None,
            image_std=tuple(_channels(settings["image_std"])) if normalize else None,
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ImageProcessor:
        """preprocessor_config.json, else processor_config.json's "image_processor"."""
        config = read_json(model_dir / "preprocessor_config.json")
        if not config:
            config = read_json(model_dir / "processor_config.json").get("image_processor") or {}
        if not config:
            raise ValueError(f"{model_dir} has no preprocessor_config.json")
        return cls.from_config(config)

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """The model's input for one decoded image: float32 (channels, height, width).
        ``ValueError`` for an image more elongated than ``MAX_ASPECT_RATIO``."""
        if max(image.size) > MAX_ASPECT_RATIO * min(image.size):
            raise ValueError(
                f"the image is {image.width} x {image.height} pixels; its longer edge may be at "
                f"most {MAX_ASPECT_RATIO} times its shorter one"
            )
        if self.do_convert_rgb or image.mode != "RGB":  # the model takes three channels
            image = convert_to_rgb(image)
        if self.shortest_edge is not None or self.resize_to is not None:
            height, width = self._resized_size(image.height, image.width)
            image = image.resize((width, height), resample=self.resample)
        pixels = np.moveaxis(np.asarray(image), -1, 0)  # (height, width, 3) -> (3, height, width)
        if self.crop_to is not None:
            pixels = center_crop(pixels, *self.crop_to)
        if self.rescale_factor is not None:
            # transformers multiplies in float64, then casts to float32
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32, copy=False)
        if self.image_mean is not None and self.image_std is not None:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return np.ascontiguousarray(pixels, dtype=np.float32)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_to is not None:
            return self.resize_to
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre (height, width) of (channels, H, W) pixels, zero-padded where the image is
    smaller, as transformers' ``center_crop``."""
    original_height, original_width = pixels.shape[-2:]
    top, left = (original_height - height) // 2, (original_width - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    padded_height, padded_width = max(height, original_height), max(width, original_width)
    padded = np.zeros((pixels.shape[0], padded_height, padded_width), dtype=pixels.dtype)
    top_pad = math.ceil((padded_height - original_height) / 2)
    left_pad = math.ceil((padded_width - original_width) / 2)
    padded[:, top_pad : top_pad + original_height, left_pad : left_pad + original_width] = pixels
    top, left = max(top + top_pad, 0), max(left + left_pad, 0)
    return padded[:, top : top + height, left : left + width]


def _base_type(name: str) -> str:
    """``CLIPImageProcessorFast`` and ``CLIPImageProcessorPil`` name the same pipeline."""
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    return name


def _resize_target(
    kind: str, settings: dict[str, Any]
) -> tuple[int | None, tuple[int, int] | None]:
    """(shortest_edge, None) or (None, (height, width)) from ``size``; (None, None): no resize."""
    if not settings["do_resize"]:
        return None, None
    size = settings["size"]
    if isinstance(size, int):  # older files: one number, an edge for CLIP, a square for SigLIP
        return (size, None) if kind == "CLIPImageProcessor" else (None, (size, size))
    if isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return int(size["shortest_edge"]), None
    square = _square(size)
    if square is None:
        raise ValueError(f"image size {size!r} is not supported")
    return None, square


def _square(size: Any) -> tuple[int, int] | None:
    if isinstance(size, int):
        return size, size
    if isinstance(size, dict) and {"height", "width"} <= set(size):
        return int(size["height"]), int(size["width"])
    return None


def _channels(value: float | list[float]) -> list[float]:
    return [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
