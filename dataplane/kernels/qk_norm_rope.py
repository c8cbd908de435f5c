"""Qwen3's per-head RMSNorm of q and k followed by neox-style RoPE, in one launch.

On the decode path these were three launches per layer (q norm, k norm, rotary) of a few
microseconds each on a few hundred kilobytes: 8.1 us per layer of a 256-row Qwen3-0.6B decode
step on an H200, 2.8 us as this one kernel (bench/profile_decode.py). One program per token
reads its q and k heads once and writes them once. Rounding follows the torch code (dataplane/layers/layernorm.py, then
dataplane/layers/rotary.py): the normalized value rounds to the activation dtype, the weight
product rounds again, the rotation is done in float32 and rounds once.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rotate_heads(x_ptr, out_ptr, weight_ptr, token, stride_tok, stride_head,
                       stride_out_tok, stride_out_head, num_heads, cos, sin, eps,
                       HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    ptr = x_ptr + token * stride_tok + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, HALF]
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    dtype = out_ptr.dtype.element_ty
    w1 = tl.load(weight_ptr + dims).to(tl.float32)[None, :]  # [1, HALF]
    w2 = tl.load(weight_ptr + HALF + dims).to(tl.float32)[None, :]
    n1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    n2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(dst, (n1 * cos - n2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (n2 * cos + n1 * sin).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["num_heads", "num_kv_heads"])
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr,
    num_heads, num_kv_heads, eps, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    stride_q_out_tok, stride_k_out_tok, stride_cache_pos,
    HALF: tl.constexpr, BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cache_pos + dims)[None, :]  # [1, HALF]
    sin = tl.load(cos_sin_ptr + pos * stride_cache_pos + HALF + dims)[None, :]
    _norm_rotate_heads(q_ptr, q_out_ptr, q_weight_ptr, token, stride_q_tok, stride_q_head,
                       stride_q_out_tok, 2 * HALF, num_heads, cos, sin, eps, HALF, BLOCK_Q_HEADS)
    _norm_rotate_heads(k_ptr, k_out_ptr, k_weight_ptr, token, stride_k_tok, stride_k_head,
                       stride_k_out_tok, 2 * HALF, num_kv_heads, cos, sin, eps, HALF,
                       BLOCK_K_HEADS)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [num_tokens] int64; q: [num_tokens, num_heads, head_dim]; k: [num_tokens,
    num_kv_heads, head_dim] (rows may be strided, e.g. views of the fused QKV output; head_dim
    contiguous); weights: [head_dim]; cos_sin_cache: [max_position, head_dim] float32 (cos,
    then sin). Returns new contiguous (q, k)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and q.dtype == k.dtype
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert q_weight.shape == k_weight.shape == (head_dim,)
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.stride(1) == 1
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two"
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _qk_norm_rope_kernel[(num_tokens,)](
        q, k, q_out, k_out, q_weight, k_weight, positions, cos_sin_cache, num_heads,
        num_kv_heads, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0),
        HALF=head_dim // 2, BLOCK_Q_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(num_kv_heads), num_warps=4,
    )
    return q_out, k_out


def qk_norm_rope_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch code of the model on CPU: RMSNorm of each head, then RoPE."""
    from dataplane.kernels.rmsnorm import rms_norm_ref
    from dataplane.layers.rotary import apply_rope
    return apply_rope(positions, rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps),
                      cos_sin_cache)
