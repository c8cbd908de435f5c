from controlplane.block_pool import KVBlock
from controlplane.prefix_cache import PrefixCache, block_hashes, chain_hash


def test_hashes_chain_over_full_blocks_only():
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == chain_hash(None, [0, 1, 2, 3])
    assert hashes[1] == chain_hash(hashes[0], [4, 5, 6, 7])
    # the same block after another prefix hashes differently
    assert block_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != hashes[1]
    # continuing from a known parent gives the same chain
    assert block_hashes(tokens, 4, start=1, parent=hashes[0]) == hashes[1:]
    assert block_hashes(tokens, 4, end=1) == hashes[:1]
    assert block_hashes(tokens, 4, start=1, parent=hashes[0], end=5) == hashes[1:]


def test_lookup_returns_the_longest_hit_prefix_and_checks_tokens():
    cache = PrefixCache()
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4)
    blocks = [KVBlock(i) for i in range(3)]
    cache.insert(blocks[0], hashes[0], tokens[0:4])
    cache.insert(blocks[2], hashes[2], tokens[8:12])  # unreachable: block 1 is missing
    assert cache.lookup(hashes, tokens, 4) == [blocks[0]]
    cache.insert(blocks[1], hashes[1], tokens[4:8])
    assert cache.lookup(hashes, tokens, 4) == blocks


def test_a_hash_collision_never_serves_wrong_tokens():
    cache = PrefixCache()
    block = KVBlock(0)
    forged = chain_hash(None, [1, 2, 3, 4])
    cache.insert(block, forged, [9, 9, 9, 9])  # same key, other tokens
    assert cache.lookup([forged], [1, 2, 3, 4], 4) == []


def test_evict_removes_the_entry():
    cache = PrefixCache()
    block = KVBlock(0)
    h = chain_hash(None, [1, 2, 3, 4])
    cache.insert(block, h, [1, 2, 3, 4])
    cache.evict(block)
    assert len(cache) == 0 and block.block_hash is None
