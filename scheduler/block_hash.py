"""Content hashes of full KV blocks, chained so that one hash names a block's whole prefix.

A block's hash covers its parent's hash, its token ids and any extra keys: the cache salt, for
the first block, and the hash of every image whose tokens the block holds (image tokens are one
placeholder id repeated; the pixels tell them apart). Two requests share a cached block only if
everything before it matches too. The first block of a request that runs with a LoRA adapter
has a parent of its own, the adapter's root hash (``lora_root``): the same tokens make other
keys and values under another adapter, and another adapter (or the base model) can never reach
that parent, a SHA-256 digest of a distinct input, as the base model's first blocks have none.
SHA-256 keeps collisions, which would hand one tenant another's cached state, out of reach, and
every part goes in with its length, so no two different lists of parts hash the same bytes.

Token ids must fit int64: the scheduler admits only prompts whose ids are below the vocabulary
size (``scheduler.admission.context_problem``), so a hostile id never reaches a hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from interfaces import ImageMetadata

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """The hash of one full block of ``token_ids`` that follows the block hashed ``parent``
    (``OverflowError`` for an id outside int64)."""
    digest = hashlib.sha256(parent or b"")
    tokens = array("q", token_ids).tobytes()
    digest.update(len(tokens).to_bytes(8, "little") + tokens)
    for key in extra_keys:
        encoded = key.encode()
        digest.update(len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def lora_root(lora_id: int) -> BlockHash:
    """The parent of the first block of a request running with adapter ``lora_id`` (> 0)."""
    return hashlib.sha256(b"switchyard-lora-adapter:" + lora_id.to_bytes(8, "little")).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    images: Sequence[ImageMetadata] = (),
    lora_id: int = 0,
) -> None:
    """Append the hashes of every full block of ``token_ids`` not hashed yet (of a request
    running with LoRA adapter ``lora_id``; 0: the base model)."""
    root = lora_root(lora_id) if lora_id else None
    for index in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[-1] if block_hashes else root
        start, end = index * block_size, (index + 1) * block_size
        extra_keys = [cache_salt] if index == 0 and cache_salt is not None else []
        extra_keys += [i.image_hash for i in images if i.start_idx < end and start < i.end_idx]
        block_hashes.append(hash_block(parent, token_ids[start:end], extra_keys))
