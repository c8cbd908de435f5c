"""Prefix cache over full KV blocks.

A full block is keyed by a chained hash: sha256(parent block's hash || the block's token ids),
so a key names the whole prefix up to and including the block. A hit also compares the tokens
stored with the block, so even a hash collision can never serve wrong KV.
"""

import hashlib
from collections.abc import Sequence

from common.wire import pack_i32
from controlplane.block_pool import KVBlock


def chain_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    h = hashlib.sha256(parent or b"")
    h.update(pack_i32(token_ids))
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, start: int = 0,
                 parent: bytes | None = None, end: int | None = None) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from block index `start` on, up to block `end`
    (exclusive; default: every full block), chained on `parent` (the hash of block start - 1).
    Reads only those blocks' tokens, so a caller passes the whole list, not a copy of a slice."""
    stop = len(token_ids) if end is None else min(len(token_ids), end * block_size)
    out = []
    for begin in range(start * block_size, stop - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[begin:begin + block_size])
        out.append(parent)
    return out


class PrefixCache:
    def __init__(self) -> None:
        self.hash_to_block: dict[bytes, KVBlock] = {}

    def __len__(self) -> int:
        return len(self.hash_to_block)

    def lookup(self, hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int
               ) -> list[KVBlock]:
        """The cached blocks of the longest prefix of `token_ids` whose every block hits."""
        hits = []
        for i, block_hash in enumerate(hashes):
            block = self.hash_to_block.get(block_hash)
            if block is None or block.token_ids != tuple(token_ids[i * block_size:(i + 1) * block_size]):
                break
            hits.append(block)
        return hits

    def insert(self, block: KVBlock, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full block. A block already cached under this hash keeps the entry."""
        if block.block_hash is not None or block_hash in self.hash_to_block:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.hash_to_block[block_hash] = block

    def evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self.hash_to_block.get(block.block_hash) is block:
            del self.hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None
