"""Exact block ids, reference counts and eviction order of the block manager."""

from __future__ import annotations

import pytest

from interfaces import ImageMetadata, SharedMemoryArray, TextContext
from scheduler.block_hash import extend_block_hashes, hash_block
from scheduler.block_manager import BlockManager
from scheduler.request import Request


def request(request_id, prompt, cache_salt=None):
    context = TextContext(request_id, list(prompt), len(prompt) + 16, cache_salt=cache_salt)
    return Request(context, b"client", max_model_len=1024)


def compute(manager, req, num_tokens):
    """Pretend a step computed ``num_tokens`` more tokens of ``req`` and register full blocks."""
    req.num_computed_tokens += num_tokens
    manager.cache_full_blocks(req)


def admit(manager, req):
    """What the scheduler does for a waiting request: reuse the prefix, allocate the rest."""
    prefix = manager.find_cached_prefix(req)
    num_cached = len(prefix) * manager.block_size
    new_block_ids = manager.allocate_slots(req, req.num_tokens - num_cached, prefix)
    if new_block_ids is not None:
        req.num_computed_tokens = num_cached
    return [block.block_id for block in prefix], new_block_ids


def test_hashes_chain_over_the_prefix_and_the_salt():
    first = hash_block(None, [1, 2, 3, 4])
    assert first == hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ["tenant-a"]) != first
    hashes = []
    extend_block_hashes(hashes, list(range(10)), 4, cache_salt=None)
    assert hashes == [hash_block(None, [0, 1, 2, 3]), hash_block(hashes[0], [4, 5, 6, 7])]


def test_blocks_holding_image_tokens_are_keyed_by_the_images_hash():
    pixels = SharedMemoryArray("switchyard_00000000_" + "0" * 24, (3, 2, 2), "float32")

    def image(start, end, image_hash):
        return ImageMetadata(start, end, pixels, image_hash)

    tokens = [7, 9, 9, 9, 9, 9, 9, 8, 5, 5, 5, 5]  # 9: an image's six tokens, at 1-6

    def hashes(images):
        result = []
        extend_block_hashes(result, tokens, 4, cache_salt=None, images=images)
        return result

    plain, cat, dog = hashes([]), hashes([image(1, 7, "cat")]), hashes([image(1, 7, "dog")])
    assert cat == hashes([image(1, 7, "cat")])  # the same image: the same blocks
    assert cat[0] == hash_block(None, tokens[:4], ["cat"])
    assert cat[1] == hash_block(cat[0], tokens[4:8], ["cat"])  # the image's last three tokens
    assert cat[2] == hash_block(cat[1], tokens[8:])  # no image tokens, but a cat before
    assert len({plain[0], cat[0], dog[0]}) == 3 and len({plain[2], cat[2], dog[2]}) == 3
    two = hashes([image(1, 4, "cat"), image(4, 7, "dog")])
    assert two[1] == hash_block(two[0], tokens[4:8], ["dog"])  # only the image it holds


def test_allocation_takes_the_lowest_free_ids_first_and_frees_tail_first():
    manager = BlockManager(num_blocks=8, block_size=4)
    a = request("a", range(10))
    assert manager.allocate_slots(a, 10) == [0, 1, 2]
    b = request("b", range(100, 105))
    assert manager.allocate_slots(b, 5) == [3, 4]
    manager.free(a)
    # The free queue now reads 5, 6, 7 (never used), then a's blocks tail first: 2, 1, 0.
    c = request("c", range(200, 224))
    assert manager.allocate_slots(c, 24) == [5, 6, 7, 2, 1, 0]
    assert manager.allocate_slots(request("d", [1]), 1) is None
    manager.check_integrity(holders=[b, c])


def test_ask_then_commit_changes_nothing_on_failure():
    manager = BlockManager(num_blocks=4, block_size=4)
    a = request("a", range(12))
    assert manager.allocate_slots(a, 12) == [0, 1, 2]
    big = request("big", range(8))
    assert manager.allocate_slots(big, 8) is None
    assert (big.block_ids, manager.num_free_blocks) == ([], 1)
    manager.check_integrity(holders=[a])


def test_a_second_request_reuses_the_cached_prefix_and_computes_only_the_tail():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks and 2 tokens
    first = request("first", prompt)
    assert admit(manager, first) == ([], [0, 1, 2, 3])
    compute(manager, first, 14)
    assert manager.num_cached_blocks == 3

    second = request("second", prompt)
    assert admit(manager, second) == ([0, 1, 2], [4])
    assert second.num_computed_tokens == 12
    assert [manager.blocks[i].ref_count for i in range(5)] == [2, 2, 2, 1, 1]
    manager.check_integrity(holders=[first, second])


def test_a_fully_cached_prompt_still_computes_its_last_block():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    first = request("first", prompt)
    admit(manager, first)
    compute(manager, first, 8)
    second = request("second", prompt)
    assert admit(manager, second) == ([0], [2])
    assert second.num_computed_tokens == 4


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=6, block_size=2)
    old = request("old", [1, 2, 3, 4])
    admit(manager, old)
    compute(manager, old, 4)
    new = request("new", [5, 6, 7, 8])
    admit(manager, new)
    compute(manager, new, 4)
    manager.free(old)
    manager.free(new)
    assert manager.num_cached_blocks == 4
    manager.check_integrity(holders=[])
    # Queue: 4, 5 (never used), old's 1, 0, then new's 3, 2. Four blocks evict old's entirely.
    filler = request("filler", range(100, 108))
    assert manager.allocate_slots(filler, 8) == [4, 5, 1, 0]
    assert admit(manager, request("old-again", [1, 2, 3, 4, 9]))[0] == []
    manager.free(filler)
    assert admit(manager, request("new-again", [5, 6, 7, 8, 9]))[0] == [2, 3]


def test_a_cache_hit_on_an_idle_block_counts_against_free_space():
    manager = BlockManager(num_blocks=3, block_size=2)
    first = request("first", [1, 2, 3])
    admit(manager, first)
    compute(manager, first, 3)
    manager.free(first)  # block 0 cached (full), block 1 free
    second = request("second", [1, 2, 3, 4, 5, 6, 7])
    # Reusing block 0 takes it out of the free queue, leaving 2 blocks for 3 needed.
    assert manager.allocate_slots(second, 5, manager.find_cached_prefix(second)) is None
    assert second.block_ids == []
    manager.check_integrity(holders=[])


@pytest.mark.parametrize("salts", [("tenant-a", "tenant-b"), ("tenant-a", None)])
def test_cache_salt_keeps_tenants_apart(salts):
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 11))
    first = request("first", prompt, cache_salt=salts[0])
    admit(manager, first)
    compute(manager, first, 10)
    assert admit(manager, request("other", prompt, cache_salt=salts[1]))[0] == []
    assert admit(manager, request("same", prompt, cache_salt=salts[0]))[0] == [0, 1]


def test_disabled_prefix_caching_never_hits():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = request("first", range(12))
    admit(manager, first)
    compute(manager, first, 12)
    assert manager.num_cached_blocks == 0
    assert admit(manager, request("second", range(12)))[0] == []


def test_identical_blocks_computed_twice_are_cached_once():
    manager = BlockManager(num_blocks=8, block_size=2)
    a, b = request("a", [1, 2, 3]), request("b", [1, 2, 3])
    admit(manager, a)
    admit(manager, b)  # both admitted before either computed anything: no sharing
    compute(manager, a, 3)
    compute(manager, b, 3)
    assert manager.num_cached_blocks == 1
    assert (manager.blocks[0].block_hash is not None, manager.blocks[2].block_hash) == (True, None)
    manager.free(a)
    manager.free(b)
    manager.check_integrity(holders=[])


def test_integrity_check_catches_a_wrong_ref_count():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = request("a", [1, 2, 3])
    manager.allocate_slots(a, 3)
    manager.blocks[0].ref_count = 2
    with pytest.raises(RuntimeError, match="ref_counts differ"):
        manager.check_integrity(holders=[a])
