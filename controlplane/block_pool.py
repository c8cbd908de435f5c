"""KV blocks with reference counts and an O(1) free queue.

The free queue is a doubly linked list threaded through the blocks themselves: taking a free
block, returning one, and pulling a cached-but-free block out of the middle on a prefix hit are
all O(1). Freed blocks go to the tail and blocks are taken from the head, so the blocks freed
longest ago (least recently used) are evicted from the prefix cache first.

Blocks are created when first handed out (a small model on a large GPU can have millions): the
never-used ones sit, by id, ahead of the queue, as if it had been filled with all of them.
"""

from collections.abc import Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache
        self.token_ids: tuple[int, ...] | None = None  # its tokens, compared on a prefix hit
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: the list is never empty of nodes
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "no free block"
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Hands out blocks; a block is free when no request references it. Free blocks may still
    hold a prefix-cache entry until they are handed out again (`on_evict` drops it)."""

    def __init__(self, num_blocks: int, on_evict=None) -> None:
        assert num_blocks > 0
        self._num_blocks = num_blocks
        self.blocks: list[KVBlock] = []  # those handed out at least once, by id
        self.free_queue = FreeBlockQueue(())  # of those, the unreferenced ones
        self._on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_blocks - len(self.blocks) + self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they are handed out (for tests and checks)."""
        return [*range(len(self.blocks), self._num_blocks), *(b.block_id for b in self.free_queue)]

    def allocate(self, n: int) -> list[KVBlock]:
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        out = []
        for _ in range(n):
            if len(self.blocks) < self._num_blocks:  # never used yet: first in line
                block = KVBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                block = self.free_queue.popleft()
                if block.block_hash is not None and self._on_evict is not None:
                    self._on_evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference (a prefix hit), pulling free blocks out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
