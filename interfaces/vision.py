"""How many prompt positions one image takes in a LLaVA-style model.

The API server expands each image token of a prompt to this many, and the worker splices that
many rows of image features in; both count from the model's config.json with this one rule.
"""

from __future__ import annotations

VISION_TOWERS_WITH_CLASS_TOKEN = ("clip_vision_model",)
"""Vision towers whose output starts with a class position (SigLIP's has none)."""
FEATURE_SELECT_STRATEGIES = ("default", "full")


def num_image_tokens(
    tower_type: str, image_size: int, patch_size: int, feature_select_strategy: str
) -> int:
    """As transformers' ``LlavaProcessor`` counts them: one per patch, plus the class position
    for a tower that has one, less that position under the "default" strategy (which drops
    it). ``ValueError`` for a strategy other than "default" or "full"."""
    if feature_select_strategy not in FEATURE_SELECT_STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy {feature_select_strategy!r}")
    num_positions = (image_size // patch_size) ** 2
    num_positions += tower_type in VISION_TOWERS_WITH_CLASS_TOKEN
    return num_positions - (feature_select_strategy == "default")
