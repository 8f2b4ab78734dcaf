"""The embedding model (worker.embeddings) against sentence-transformers, its reference."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from worker.embeddings import EmbeddingsGenerator, Pooling, default_embedding_model_dir

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hex")  # fmt: skip


@pytest.fixture(scope="module")
def model_dir():
    return default_embedding_model_dir()


@pytest.fixture(scope="module")
def generator(model_dir):
    return EmbeddingsGenerator(model_dir)


def texts(count: int) -> list[str]:
    """Inputs of many lengths, up to a couple of hundred tokens."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 37) % 180))
            for i in range(count)]  # fmt: skip


def test_a_batch_of_100_matches_sentence_transformers(model_dir, generator):
    from sentence_transformers import SentenceTransformer

    inputs = texts(100)
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(inputs)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads and truncates every input to 128 tokens
    tokenizer.no_truncation()
    batch = {f"e{i}": tokenizer.encode(text).ids for i, text in enumerate(inputs)}
    embeddings = generator.encode(batch)
    assert list(embeddings) == list(batch)
    got = np.stack(list(embeddings.values()))
    assert got.shape == (100, 384) and got.dtype == np.float32
    cosine = (got * reference).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.9999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalized, as configured


def test_the_pooling_comes_from_the_models_sentence_transformers_files(model_dir, generator):
    assert generator.pooling == Pooling(mode="mean", normalize=True, max_seq_length=256)
    assert generator.dimensions == 384


def test_inputs_that_are_empty_or_too_long_are_refused(generator):
    with pytest.raises(ValueError, match="has 257 tokens; the embedding model takes 1 to 256"):
        generator.encode({"long": [101] + [1000] * 255 + [102]})
    with pytest.raises(ValueError, match="has 0 tokens"):
        generator.encode({"empty": []})
    assert generator.encode({}) == {}
