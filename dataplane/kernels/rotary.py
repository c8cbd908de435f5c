"""Neox-style rotary embedding (rotate-half), applied in place to q and k in one launch.

cos_sin_cache: [max_position, head_dim] float32, cos in the first half of each row and sin in the
second (dataplane/layers/rotary.py builds it). Math in float32, rounded once, as the torch code.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, token, stride_tok, stride_head, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    ptr = x_ptr + token * stride_tok + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, HALF]
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_heads", "num_kv_heads"])
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    num_heads, num_kv_heads, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    stride_cache_pos,
    HALF: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cache_pos + dims)[None, :]  # [1, HALF]
    sin = tl.load(cos_sin_ptr + pos * stride_cache_pos + HALF + dims)[None, :]
    _rotate_heads(q_ptr, token, stride_q_tok, stride_q_head, num_heads, cos, sin,
                  HALF, BLOCK_Q_HEADS)
    _rotate_heads(k_ptr, token, stride_k_tok, stride_k_head, num_kv_heads, cos, sin,
                  HALF, BLOCK_K_HEADS)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place. positions: [num_tokens] int64; q: [num_tokens, num_heads, head_dim]; k:
    [num_tokens, num_kv_heads, head_dim]; rows may be strided, head_dim contiguous.
    Returns (q, k)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and q.dtype == k.dtype
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.stride(1) == 1
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two"
    if num_tokens == 0:
        return q, k
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=head_dim // 2, BLOCK_Q_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(num_kv_heads), num_warps=4,
    )
    return q, k


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, the torch code of dataplane/layers/rotary.py."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_dim / 2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
