"""Qwen3's attention prologue in one launch: per-head RMSNorm of q and k, neox-style RoPE, and
the store of k and v at their slots of the paged KV cache.

On the decode path these were three launches per layer (q norm, k norm, rotary) of a few
microseconds each on a few hundred kilobytes: 8.1 us per layer of a 256-row Qwen3-0.6B decode
step on an H200, 2.8 us as one kernel (bench/profile_decode.py); the K/V store (1.8 us) was one
more launch. One program per token reads its q, k and v heads once and writes q out and k and v
into the cache. Rounding follows the torch code (dataplane/layers/layernorm.py, then
dataplane/layers/rotary.py): the normalized value rounds to the activation dtype, the weight
product rounds again, the rotation is done in float32 and rounds once.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.pdl import launch_options, wait_for_inputs
from dataplane.kernels.sizes import next_power_of_2


@triton.jit
def _norm_rotate_heads(x_row, out_row, weight_ptr, stride_head, stride_out_head, num_heads,
                       cos, sin, eps, is_stored, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    ptr = x_row + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, HALF]
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    dtype = out_row.dtype.element_ty
    w1 = tl.load(weight_ptr + dims).to(tl.float32)[None, :]  # [1, HALF]
    w2 = tl.load(weight_ptr + HALF + dims).to(tl.float32)[None, :]
    n1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    n2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    dst = out_row + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(dst, (n1 * cos - n2 * sin).to(dtype), mask=mask & is_stored)
    tl.store(dst + HALF, (n2 * cos + n1 * sin).to(dtype), mask=mask & is_stored)


@triton.jit(do_not_specialize=["num_heads", "num_kv_heads"])
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, q_weight_ptr, k_weight_ptr,
    positions_ptr, cos_sin_ptr, slot_mapping_ptr,
    num_heads, num_kv_heads, eps, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head, stride_q_out_tok,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_cos_sin_pos,
    HALF: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin_pos + dims)[None, :]  # [1, HALF]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin_pos + HALF + dims)[None, :]
    _norm_rotate_heads(q_ptr + token * stride_q_tok, q_out_ptr + token * stride_q_out_tok,
                       q_weight_ptr, stride_q_head, 2 * HALF, num_heads, cos, sin, eps, True,
                       HALF, BLOCK_Q_HEADS)
    slot = tl.load(slot_mapping_ptr + token)
    is_stored = slot >= 0  # a negative slot is a padding row: nothing is written
    row = (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_tok
    _norm_rotate_heads(k_ptr + token * stride_k_tok, k_cache_ptr + row, k_weight_ptr,
                       stride_k_head, stride_cache_head, num_kv_heads, cos, sin, eps, is_stored,
                       HALF, BLOCK_K_HEADS)
    heads = tl.arange(0, BLOCK_K_HEADS)
    full = tl.arange(0, 2 * HALF)
    mask = (heads < num_kv_heads)[:, None]
    v = tl.load(v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + full[None, :],
                mask=mask)  # [BLOCK_K_HEADS, HEAD_DIM]
    tl.store(v_cache_ptr + row + heads[:, None] * stride_cache_head + full[None, :], v,
             mask=mask & is_stored)


def qk_norm_rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       q_out: torch.Tensor | None = None) -> torch.Tensor:
    """positions: [num_tokens] int64; q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens,
    num_kv_heads, head_dim] (rows may be strided, e.g. views of the fused QKV output; head_dim
    contiguous); weights: [head_dim]; cos_sin_cache: [max_position, head_dim] float32 (cos,
    then sin); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one set of
    strides; slot_mapping: [num_tokens] int64, negative = skip (store_kv's contract).
    Writes the normalized, rotated k and the given v at their slots; returns the normalized,
    rotated q in q_out (q's shape and dtype, contiguous) or, without it, a new tensor."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "one dtype for all"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert q_weight.shape == k_weight.shape == (head_dim,)
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    assert positions.shape == slot_mapping.shape == (num_tokens,)
    assert positions.dtype == slot_mapping.dtype == torch.int64
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.stride(1) == 1
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(3) == 1
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert q_out.shape == q.shape and q_out.dtype == q.dtype and q_out.is_contiguous()
    if num_tokens == 0:
        return q_out
    _qk_norm_rope_store_kernel[(num_tokens,)](
        q, k, v, q_out, k_cache, v_cache, q_weight, k_weight, positions, cos_sin_cache,
        slot_mapping, num_heads, num_kv_heads, eps, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_sin_cache.stride(0),
        HALF=head_dim // 2, BLOCK_Q_HEADS=next_power_of_2(num_heads),
        BLOCK_K_HEADS=next_power_of_2(num_kv_heads), PAGE_SIZE=block_size, num_warps=4,
        **launch_options(q.device, num_tokens),
    )
    return q_out


def qk_norm_rope_store_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The torch code of the model on CPU: RMSNorm of each head, RoPE, the store."""
    from dataplane.kernels.rmsnorm import rms_norm_ref
    from dataplane.kernels.store_kv import store_kv_ref
    from dataplane.layers.rotary import apply_rope
    q, k = apply_rope(positions, rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps),
                      cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q
