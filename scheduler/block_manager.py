"""KV cache blocks: which fixed-size blocks of the worker's pool each request holds.

Pure bookkeeping on block ids, no tensors. Every block is in exactly one state:

- used: held by at least one running request (``ref_count > 0``); a block with a prefix shared
  by several requests is held by each of them;
- cached: held by none, but its full contents are known by hash, so a later request with the
  same prefix can take it back without recomputing;
- free: held by none and holding nothing reusable.

Cached and free blocks wait in one least-recently-freed queue. Allocation takes from its head
and evicts the hash of a cached block it takes. A request's blocks are freed last-block first,
so its tail is evicted before the prefix that other requests are more likely to share.
Allocation is ask-then-commit: ``allocate_slots`` reserves everything a step needs or changes
nothing and returns None.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.block_hash import BlockHash, extend_block_hashes
from scheduler.request import Request


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockManager:
    """Hands out block ids ``0 .. num_blocks-1`` to requests and takes them back."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._free_queue: OrderedDict[int, Block] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self._cached: dict[BlockHash, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and unreferenced cached ones."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose contents are known by hash, used or not."""
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks matching ``request``'s tokens from the start.

        At least one token is always left to compute, since the step that computes it produces
        the logits for the next token; if every block matched, the last one is dropped.
        """
        if not self.enable_prefix_caching:
            return []
        return self._cached_run(self._block_hashes(request), request.num_tokens)

    def num_cached_tokens(self, block_hashes: list[BlockHash], num_tokens: int) -> int:
        """How many of a context's ``num_tokens`` tokens, whose full blocks hash to
        ``block_hashes`` at this pool's block size, ``find_cached_prefix`` would find cached
        now (placement asks this of every group before it chooses one)."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._cached_run(block_hashes, num_tokens)) * self.block_size

    def _cached_run(self, block_hashes: list[BlockHash], num_tokens: int) -> list[Block]:
        """The cached blocks of the longest prefix of ``block_hashes``, less the last one if
        they would cover all ``num_tokens`` tokens."""
        hits = []
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= num_tokens:
            hits.pop()
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: list[Block] = ()
    ) -> list[int] | None:
        """Reserve blocks so ``request`` can compute ``num_new_tokens`` more tokens.

        ``cached_prefix`` (from ``find_cached_prefix``, for a request holding no blocks yet)
        becomes the start of the request's blocks; the caller then counts its tokens as
        computed. Returns the ids of newly taken blocks, or None if there are not enough blocks,
        in which case nothing changed.
        """
        num_prefix_tokens = len(cached_prefix) * self.block_size
        total_tokens = request.num_computed_tokens + num_prefix_tokens + num_new_tokens
        held = len(request.block_ids) + len(cached_prefix)
        num_needed = self.num_blocks_for(total_tokens) - held
        if num_needed <= 0 and not cached_prefix:
            return []  # the blocks held have room (most decode steps)
        num_needed = max(num_needed, 0)
        num_revived = sum(1 for block in cached_prefix if block.ref_count == 0)
        if num_needed > len(self._free_queue) - num_revived:
            return None
        for block in cached_prefix:
            self._take(block)
        if cached_prefix:
            request.block_ids.extend(block.block_id for block in cached_prefix)
            request.num_cached_blocks = len(cached_prefix)
        new_block_ids = [self._allocate_block() for _ in range(num_needed)]
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Record by hash every block of ``request`` that is full of computed tokens it knows
        (draft tokens in flight are computed but not known: ``scheduler.speculative``)."""
        if not self.enable_prefix_caching:
            return
        num_known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_known // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return  # no block filled up since the last call (most decode steps)
        block_hashes = self._block_hashes(request)
        for index in range(request.num_cached_blocks, num_full):
            block = self.blocks[request.block_ids[index]]
            block_hash = block_hashes[index]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def forget_from(self, request: Request, position: int) -> None:
        """Forget the contents of ``request``'s blocks from the one holding token ``position``
        on: the step that computed them went wrong for this request."""
        for block_id in request.block_ids[position // self.block_size :]:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every block's contents (after a failed step); block ownership is unchanged."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

    def free(self, request: Request) -> None:
        """Release ``request``'s blocks, last block first; cached ones stay reusable."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = block
        request.block_ids = []
        request.num_cached_blocks = 0

    def check_integrity(self, holders: Iterable[Request] | None = None) -> None:
        """Raise ``RuntimeError`` unless the block states are consistent.

        free + cached + used == total, every cached block is indexed under its own hash, and,
        when ``holders`` (every request holding blocks) is given, each block's ref_count equals
        the number of those requests holding it.
        """
        problems = list(self._problems(holders))
        if problems:
            raise RuntimeError("; ".join(problems))

    def _problems(self, holders: Iterable[Request] | None):
        used = [b for b in self.blocks if b.ref_count > 0]
        idle = [b for b in self.blocks if b.ref_count == 0]
        if any(b.ref_count < 0 for b in self.blocks):
            yield "a block has a negative ref_count"
        if {b.block_id for b in idle} != set(self._free_queue):
            yield "the free queue does not hold exactly the unreferenced blocks"
        num_cached_idle = sum(1 for b in idle if b.block_hash is not None)
        num_free = len(idle) - num_cached_idle
        if num_free + num_cached_idle + len(used) != self.num_blocks:
            yield f"free {num_free} + cached {num_cached_idle} + used {len(used)} != total"
        if any(block.block_hash != key for key, block in self._cached.items()):
            yield "a cached block is indexed under another hash"
        if holders is not None:
            counts = [0] * self.num_blocks
            for request in holders:
                for block_id in request.block_ids:
                    counts[block_id] += 1
            if counts != [b.ref_count for b in self.blocks]:
                yield "ref_counts differ from the requests holding the blocks"

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.context.cache_salt,
            request.context.images,
            request.context.lora_id,
        )
        return request.block_hashes

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free_queue[block.block_id]
        block.ref_count += 1

    def _allocate_block(self) -> int:
        _, block = self._free_queue.popitem(last=False)
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block.block_id
