"""Which KV blocks each request holds. The scheduler asks for blocks and gets block ids or None;
it never sees free lists or hash maps."""

from collections import Counter
from dataclasses import dataclass

from controlplane.block_pool import BlockPool, KVBlock
from controlplane.prefix_cache import PrefixCache, block_hashes
from controlplane.request import Request


@dataclass(frozen=True)
class PrefixHit:
    """Opaque to the scheduler: cached blocks a new request can start from."""

    blocks: tuple[KVBlock, ...]
    num_tokens: int


NO_HIT = PrefixHit((), 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache = PrefixCache()
        self.pool = BlockPool(num_blocks, on_evict=self.cache.evict)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # Hashes of each request's full blocks so far; they survive preemption (tokens only grow).
        self.req_to_hashes: dict[str, list[bytes]] = {}
        self.req_to_num_cached: dict[str, int] = {}  # leading blocks registered in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request's tokens, leaving at least its last token to
        compute (the step needs that token's logits)."""
        if not self.enable_prefix_caching:
            return NO_HIT
        num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, num_blocks)[:num_blocks]
        hits = self.cache.lookup(hashes, request.token_ids, self.block_size)
        return PrefixHit(tuple(hits), len(hits) * self.block_size)

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT
                 ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones (after `hit` for a
        request being admitted). Returns the ids appended to its block table, or None when they
        do not fit (nothing changes then)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks:
            num_needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
            if num_needed <= len(blocks):
                return []  # a decode step inside its last block: most steps
            assert not hit.blocks, "a prefix hit is only for a request without blocks"
        else:
            num_needed = -(-(hit.num_tokens + num_new_tokens) // self.block_size)
        num_new = num_needed - (len(blocks) if blocks else 0) - len(hit.blocks)
        num_revived = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        if num_new + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(hit.blocks)
        added = [*hit.blocks, *self.pool.allocate(max(num_new, 0))]
        self.req_to_blocks.setdefault(request.request_id, []).extend(added)
        return [b.block_id for b in added]

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are known and whose KV is computed or
        being computed by a step already sent (steps run in order, so any step that could read
        a cached block runs after it), so others can share them."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_known // self.block_size, len(blocks))
        start = self.req_to_num_cached.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            self.cache.insert(blocks[i], hashes[i], request.token_ids[i * bs:(i + 1) * bs])
        self.req_to_num_cached[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (the tail first, so the prefix's blocks stay cached
        longest). Cached blocks stay in the cache until they are handed out again."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free(reversed(blocks))
        self.req_to_num_cached.pop(request.request_id, None)
        if request.is_finished:
            self.req_to_hashes.pop(request.request_id, None)

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's block hashes, computed up to at least its first num_blocks blocks (the
        list itself, which may hold more: no copy on the per-step path)."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            hashes.extend(block_hashes(request.token_ids, self.block_size, start=len(hashes),
                                       parent=hashes[-1] if hashes else None, end=num_blocks))
        return hashes

    def check_invariants(self) -> None:
        """For tests: reference counts match holders, the free queue holds exactly the
        unreferenced blocks, no request holds a block twice, cache entries are consistent."""
        holders = Counter()
        for request_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice: {ids}"
            holders.update(ids)
        free = set(self.pool.free_block_ids())
        assert len(free) == self.pool.num_free_blocks
        for block in self.pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders[block.block_id], (block, holders[block.block_id])
            assert (block.ref_cnt == 0) == (block.block_id in free), block
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks
        for block_hash, block in self.cache.hash_to_block.items():
            assert block.block_hash == block_hash and block.token_ids is not None
