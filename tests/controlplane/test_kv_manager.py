from controlplane.kv_manager import KVCacheManager
from controlplane.request import FinishReason
from tests.controlplane.factories import BLOCK_SIZE, make_request


def test_allocate_exact_block_ids_then_none_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a, b = make_request("a", 6), make_request("b", 5)
    assert kv.allocate(a, 6) == [0, 1]
    a.num_computed_tokens = 6
    assert kv.allocate(a, 1) == []  # the 7th token fits block 1
    a.num_computed_tokens = 7
    assert kv.allocate(b, 5) == [2, 3]
    a.num_computed_tokens = 8
    assert kv.allocate(a, 1) is None  # a 9th token needs a third block: none left
    assert kv.req_to_blocks["a"] and kv.num_free_blocks == 0
    kv.check_invariants()


def test_prefix_hit_shares_full_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("first", list(range(10)))
    assert kv.allocate(first, 10) == [0, 1, 2]
    first.num_computed_tokens = 10
    kv.cache_computed_blocks(first)  # blocks 0 and 1 are full
    second = make_request("second", list(range(8)))  # exactly two blocks
    hit = kv.find_prefix(second)
    assert [b.block_id for b in hit.blocks] == [0] and hit.num_tokens == 4  # not all 8
    third = make_request("third", list(range(9)) + [77])
    hit = kv.find_prefix(third)
    assert hit.num_tokens == 8
    assert kv.allocate(third, 2, hit) == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    kv.check_invariants()


def test_freed_cached_blocks_stay_hittable_until_reused():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    a.finish(FinishReason.LENGTH)
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = make_request("b", list(range(8)) + [5])
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 8
    # the hit revives blocks 0 and 1 from the free queue; block 2 (a's tail) is reused
    assert kv.allocate(b, 1, hit) == [0, 1, 2]
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_reused_block_is_evicted_from_the_cache():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(5)))
    kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    a.finish(FinishReason.LENGTH)
    kv.free(a)
    c = make_request("c", [50] * 8)
    assert kv.allocate(c, 8) == [1, 0]  # a's tail first, then its cached block
    assert len(kv.cache) == 0
    assert kv.find_prefix(make_request("d", list(range(5)))).num_tokens == 0
    kv.check_invariants()
