"""What the API server knows of a vision-language (LLaVA-style) model: its image token, how many
of them one image becomes, and its image preprocessing.

A prompt holds one image token per image where the chat template put the image; before it is
sent, each is expanded to ``num_image_tokens`` copies, whose positions the worker fills with the
image's features. That count is what the vision tower yields per image: (image_size //
patch_size)² patches, plus its CLS token (CLIP towers have one, SigLIP towers none), less one
when ``vision_feature_select_strategy`` is "default" (the first feature is dropped) — the count
transformers' ``LlavaProcessor`` writes into ``input_ids`` when its ``num_additional_image_tokens``
matches the tower.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from api_server.config import read_json
from api_server.image_processor import ImageProcessor
from interfaces.vision import num_image_tokens

_IMAGE_TOKEN_KEYS = ("image_token_index", "image_token_id")


class UnsupportedVisionModel(ValueError):
    """The model takes images, but in a way the API server cannot prepare them for."""


@dataclass(frozen=True)
class VisionModel:
    """The image side of one model directory; ``load`` returns None for a text-only model."""

    image_token_id: int
    num_image_tokens: int
    """Prompt positions one image takes."""
    processor: ImageProcessor

    @classmethod
    def load(cls, model_dir: Path) -> VisionModel | None:
        """From config.json (``image_token_index`` or ``image_token_id``, ``vision_config``)
        and the preprocessor config; None when config.json names no image token and no vision
        tower. ``UnsupportedVisionModel`` for a vision model whose preprocessing or token count
        is not implemented here."""
        config = read_json(model_dir / "config.json")
        vision_config = config.get("vision_config")
        image_token_id = next((config[k] for k in _IMAGE_TOKEN_KEYS if k in config), None)
        if image_token_id is None and not isinstance(vision_config, dict):
            return None
        if not isinstance(image_token_id, int) or not isinstance(vision_config, dict):
            raise UnsupportedVisionModel(
                f"{model_dir / 'config.json'} needs both an image token id and a vision_config"
            )
        try:
            processor = ImageProcessor.from_model_dir(model_dir)
        except ValueError as error:
            raise UnsupportedVisionModel(str(error)) from error
        return cls(image_token_id, _num_image_tokens(config), processor)

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """float32 (channels, height, width) pixels for one decoded image."""
        return self.processor.preprocess(image)

    def expand_image_tokens(self, token_ids: list[int], num_images: int) -> list[int]:
        """``token_ids`` with each image token repeated ``num_image_tokens`` times.

        ``ValueError`` unless the prompt holds exactly ``num_images`` image tokens: every image
        needs its place, and an image token without an image (text that spells it, a template
        that adds one) would leave the model positions with nothing to fill them.
        """
        num_placeholders = token_ids.count(self.image_token_id)
        if num_placeholders != num_images:
            raise ValueError(
                f"the prompt holds {num_placeholders} image placeholder token(s) but the "
                f"request has {num_images} image(s); each image part must become exactly one "
                "placeholder (is the image token written in the text?)"
            )
        expanded: list[int] = []
        for token_id in token_ids:
            if token_id == self.image_token_id:
                expanded.extend([token_id] * self.num_image_tokens)
            else:
                expanded.append(token_id)
        return expanded

    def image_spans(self, expanded_token_ids: list[int]) -> list[tuple[int, int]]:
        """[start, end) of each image's tokens in an expanded prompt, in order."""
        positions = [i for i, t in enumerate(expanded_token_ids) if t == self.image_token_id]
        starts = positions[:: self.num_image_tokens]
        return [(start, start + self.num_image_tokens) for start in starts]


def _num_image_tokens(config: dict) -> int:
    vision_config = config["vision_config"]
    image_size, patch_size = vision_config.get("image_size"), vision_config.get("patch_size")
    if not isinstance(image_size, int) or not isinstance(patch_size, int) or patch_size < 1:
        raise UnsupportedVisionModel("vision_config needs integer image_size and patch_size")
    # The tower's own count (as the worker counts), not processor_config.json's
    # num_additional_image_tokens, which older llava-hf files leave out.
    try:
        return num_image_tokens(
            vision_config.get("model_type", "clip_vision_model"),
            image_size,
            patch_size,
            config.get("vision_feature_select_strategy", "default"),
        )
    except ValueError as error:
        raise UnsupportedVisionModel(str(error)) from error
