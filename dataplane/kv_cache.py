"""The paged KV cache of one rank: one tensor [2, num_layers, num_blocks, block_size,
num_kv_heads, head_dim]; layer i reads kv[0, i] (keys) and kv[1, i] (values)."""

import torch

from dataplane.attention import AttentionBackend
from dataplane.distributed import min_over_ranks
from dataplane.layers.attention import Attention


def bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    return 2 * len(layers) * block_size * layers[0].num_kv_heads * layers[0].head_dim * dtype.itemsize


def num_blocks_for(budget_bytes: int, per_block: int, cap: int | None) -> int:
    """Blocks that fit the budget (capped), agreed over the TP ranks: the smallest wins."""
    num_blocks = budget_bytes // per_block
    if cap is not None:
        num_blocks = min(num_blocks, cap)
    num_blocks = min_over_ranks(num_blocks)
    if num_blocks < 1:
        raise RuntimeError(f"no room for a single KV block of {per_block} bytes "
                           f"({budget_bytes} bytes available for the KV cache)")
    return num_blocks


def allocate_kv_cache(layers: list[Attention], num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device,
                      backend: AttentionBackend) -> torch.Tensor:
    kv = torch.zeros(2, len(layers), num_blocks, block_size, layers[0].num_kv_heads,
                     layers[0].head_dim, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(kv[0, i], kv[1, i], backend, is_first_layer=i == 0)
    return kv
