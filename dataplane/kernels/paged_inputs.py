"""The checks the paged attention launchers share on q and the paged KV cache (no kernel here)."""

import torch


def check_paged_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor) -> None:
    """q: [rows, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim], same layout and dtype as q."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"
