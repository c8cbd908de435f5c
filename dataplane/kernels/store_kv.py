"""Write each new token's key and value into the paged KV cache at its slot.

slot = block_id * block_size + offset. A negative slot marks a padding row (CUDA graphs pad the
batch to a captured size): nothing is written for it.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.sizes import next_power_of_2


@triton.jit(do_not_specialize=["num_kv_heads"])
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_kv_heads,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < num_kv_heads)[:, None] & (slot >= 0)
    k = tl.load(k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :],
                mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :],
                mask=mask)
    block = slot // PAGE_SIZE
    dst = (block * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_tok
           + heads[:, None] * stride_cache_head + dims[None, :])  # [BLOCK_HEADS, HEAD_DIM]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] (rows may be strided, e.g. views of the fused
    QKV output); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], the same
    strides; slot_mapping: [num_tokens] int64, negative = skip."""
    num_tokens, num_kv_heads, head_dim = k.shape
    block_size = k_cache.shape[1]
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (k_cache.shape, k.shape)
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "k, v and the cache share a dtype"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride()
    assert head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_HEADS=next_power_of_2(num_kv_heads),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k.shape[1:])[slots] = k[keep]
    v_cache.view(-1, *v.shape[1:])[slots] = v[keep]
