import pytest

from controlplane.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_takes_blocks_in_order_and_free_returns_them_to_the_tail():
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5
    pool.free(reversed(a))
    assert pool.free_block_ids() == [5, 1, 0]
    assert ids(pool.allocate(3)) == [5, 1, 0]


def test_touch_pulls_a_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(blocks)
    assert pool.free_block_ids() == [0, 1, 2, 3]
    pool.touch([blocks[2]])
    assert pool.free_block_ids() == [0, 1, 3] and blocks[2].ref_cnt == 1
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2
    pool.free([blocks[2]])
    assert pool.free_block_ids() == [0, 1, 3]
    pool.free([blocks[2]])
    assert pool.free_block_ids() == [0, 1, 3, 2]


def test_freeing_more_than_taken_fails_loudly():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])


def test_allocating_a_cached_block_evicts_it():
    evicted = []
    pool = BlockPool(2, on_evict=evicted.append)
    [a, b] = pool.allocate(2)
    a.block_hash = b"h"
    pool.free([a, b])
    pool.allocate(1)
    assert evicted == [a]


def test_a_huge_pool_creates_blocks_only_when_first_handed_out():
    pool = BlockPool(50_000_000)  # a tiny model on a large GPU
    assert pool.num_free_blocks == 50_000_000 and len(pool.blocks) == 0
    pool.free(pool.allocate(3))
    assert len(pool.blocks) == 3
    assert [b.block_id for b in pool.allocate(4)] == [3, 4, 5, 6]  # never-used ones first
