"""KV cache blocks: which fixed-size blocks of the worker's pool each request holds.

Pure bookkeeping: block ids only, no tensors. Allocation is ask-then-commit: ``allocate_slots``
either reserves every block a step needs or changes nothing and returns None.
"""

from __future__ import annotations

from collections import deque

from scheduler.request import Request


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class BlockManager:
    """Hands out block ids ``0 .. num_blocks-1`` to requests and takes them back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._owner_of: dict[int, str] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self._owner_of)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Reserve blocks for ``num_new_tokens`` more tokens of ``request``.

        Returns the newly added block ids (possibly empty), or None if there are not enough free
        blocks, in which case nothing changed.
        """
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = self.num_blocks_for(total_tokens) - len(request.block_ids)
        if num_needed > len(self._free_block_ids):
            return None
        new_block_ids = [self._free_block_ids.popleft() for _ in range(max(num_needed, 0))]
        for block_id in new_block_ids:
            self._owner_of[block_id] = request.request_id
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Return all of ``request``'s blocks to the pool."""
        for block_id in request.block_ids:
            del self._owner_of[block_id]
            self._free_block_ids.append(block_id)
        request.block_ids = []

    def check_integrity(self) -> None:
        """Raise ``RuntimeError`` unless free + used == total with no block in both."""
        free = set(self._free_block_ids)
        used = set(self._owner_of)
        if len(free) != len(self._free_block_ids):
            raise RuntimeError("a block id is on the free list twice")
        if free & used:
            raise RuntimeError(f"blocks both free and used: {sorted(free & used)}")
        if len(free) + len(used) != self.num_blocks:
            raise RuntimeError(
                f"free ({len(free)}) + used ({len(used)}) != total ({self.num_blocks})"
            )
