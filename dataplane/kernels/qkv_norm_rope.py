"""qkv_proj at decode batch sizes with Qwen3's attention prologue as its epilogue: the decode
GEMM (decode_matmul.py) whose every program owns one head's output columns, then, for q and k
heads, per-head RMSNorm and neox RoPE, q written out, k and v stored at their slots of the paged
KV cache. One launch where there were two (decode_matmul, then qk_norm_rope.py's kernel).

Why: in a decode step of up to pdl.MAX_ROWS rows a layer is a chain of eight dependent launches,
and even with programmatic dependent launch each link costs a few microseconds of latency
(drain, the wait, the first loads from the L2) on top of its bytes; a whole Qwen3-0.6B layer
took 27.8 us at 1 row for 7.5 us of weights (bench/results/h200/decode_layer-865485f.json). The
q/k-norm kernel moves only kilobytes, so fusing it takes a link out for the price of programs
that stream a whole head's weights (32 programs instead of 64 for Qwen3-0.6B).

A program computes its head's two halves, dims [0, HALF) and [HALF, 2 * HALF), as two
accumulators (strip_products' second strip), so that RoPE's pairs and the norm's sum sit in one
program. Rounding is the unfused path's: the float32 sums round to the dtype (decode_matmul's
output), then qk_norm_rope's norm_rotate; v is the rounded sums.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.decode_matmul import decode_matmul_config, decode_matmul_pays, strip_products
from dataplane.kernels.pdl import launch_options, prefetch_args
from dataplane.kernels.qk_norm_rope import norm_rotate, qk_norm_rope_store_ref


@triton.jit
def _store_at_slots(cache_ptr, slots, row_mask, kv_head, out1, out2, stride_cache_block,
                    stride_cache_tok, stride_cache_head, HALF: tl.constexpr,
                    PAGE_SIZE: tl.constexpr):
    """A kv head's halves [HALF, BLOCK_M] at the rows' slots (a negative slot: not stored)."""
    dims = tl.arange(0, HALF)
    is_stored = row_mask & (slots >= 0)
    dst = (cache_ptr + (slots // PAGE_SIZE) * stride_cache_block
           + (slots % PAGE_SIZE) * stride_cache_tok + kv_head * stride_cache_head)[None, :]
    tl.store(dst + dims[:, None], out1, mask=is_stored[None, :])
    tl.store(dst + HALF + dims[:, None], out2, mask=is_stored[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _qkv_norm_rope_kernel(
    x_ptr, w_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, q_weight_ptr, k_weight_ptr,
    positions_ptr, cos_sin_ptr, slot_mapping_ptr, num_rows, eps, stride_x_row,
    stride_q_out_tok, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_cos_sin_pos,
    K: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ELEMS_PER_LINE: tl.constexpr, NUM_LINES_POW2: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    head = tl.program_id(0)  # the q heads, then the k heads, then the v heads
    dims = tl.arange(0, HALF)
    acc1, acc2, rows, row_mask = strip_products(
        x_ptr, w_ptr, head * 2 * HALF + dims, num_rows, stride_x_row, K, HALF, BLOCK_M, HALF,
        BLOCK_K, DOT_PRECISION, ELEMS_PER_LINE, NUM_LINES_POW2, USE_PDL)  # [HALF, BLOCK_M] each
    dtype = q_out_ptr.dtype.element_ty
    x1 = acc1.to(dtype)
    x2 = acc2.to(dtype)
    if head < NUM_HEADS + NUM_KV_HEADS:
        is_q = head < NUM_HEADS
        pos = tl.load(positions_ptr + rows, mask=row_mask, other=0)
        cos_sin = cos_sin_ptr + pos[None, :] * stride_cos_sin_pos + dims[:, None]
        cos = tl.load(cos_sin, mask=row_mask[None, :], other=0.0)  # [HALF, BLOCK_M]
        sin = tl.load(cos_sin + HALF, mask=row_mask[None, :], other=0.0)
        w1 = tl.where(is_q, tl.load(q_weight_ptr + dims), tl.load(k_weight_ptr + dims))
        w2 = tl.where(is_q, tl.load(q_weight_ptr + HALF + dims),
                      tl.load(k_weight_ptr + HALF + dims))
        out1, out2 = norm_rotate(x1.to(tl.float32), x2.to(tl.float32),
                                 w1.to(tl.float32)[:, None], w2.to(tl.float32)[:, None], cos,
                                 sin, eps, dtype, 0, HALF)
        if is_q:
            dst = (q_out_ptr + rows[None, :].to(tl.int64) * stride_q_out_tok + head * 2 * HALF
                   + dims[:, None])
            tl.store(dst, out1, mask=row_mask[None, :])
            tl.store(dst + HALF, out2, mask=row_mask[None, :])
        else:
            slots = tl.load(slot_mapping_ptr + rows, mask=row_mask, other=-1)
            _store_at_slots(k_cache_ptr, slots, row_mask, head - NUM_HEADS, out1, out2,
                            stride_cache_block, stride_cache_tok, stride_cache_head, HALF,
                            PAGE_SIZE)
    else:
        slots = tl.load(slot_mapping_ptr + rows, mask=row_mask, other=-1)
        _store_at_slots(v_cache_ptr, slots, row_mask, head - NUM_HEADS - NUM_KV_HEADS, x1, x2,
                        stride_cache_block, stride_cache_tok, stride_cache_head, HALF,
                        PAGE_SIZE)


def qkv_norm_rope_pays(num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       hidden_size: int, dtype: torch.dtype) -> bool:
    """Where qkv_proj is the decode GEMM (decode_matmul_pays) and a head's halves make dot
    tiles (16 to 64 dims: tl.dot's smallest side, and two accumulators of a program)."""
    half = head_dim // 2
    return (decode_matmul_pays(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, hidden_size,
                               dtype)
            and 16 <= half <= 64 and half & (half - 1) == 0)


def qkv_norm_rope(x: torch.Tensor, w: torch.Tensor, num_heads: int, num_kv_heads: int,
                  positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, hidden] (rows may be strided); w: qkv_proj's [(num_heads + 2 *
    num_kv_heads) * head_dim, hidden], contiguous, x's dtype; the rest as qk_norm_rope_store
    takes them. Writes the normalized, rotated k and v at their slots (negative: skipped);
    returns the normalized, rotated q in q_out ([num_rows, num_heads, head_dim], contiguous)
    or a new tensor."""
    num_rows, hidden = x.shape
    head_dim = q_weight.shape[0]
    half = head_dim // 2
    assert w.shape == ((num_heads + 2 * num_kv_heads) * head_dim, hidden) and w.is_contiguous()
    assert x.stride(1) == 1 and x.dtype == w.dtype == k_cache.dtype == v_cache.dtype
    assert q_weight.shape == k_weight.shape == (head_dim,)
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    assert positions.shape == slot_mapping.shape == (num_rows,)
    assert positions.dtype == slot_mapping.dtype == torch.int64
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
    assert cos_sin_cache.stride(1) == 1
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(3) == 1
    block_size = k_cache.shape[1]
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"
    assert 16 <= half and half & (half - 1) == 0, "head_dim / 2: a power of two, at least 16"
    # the decode GEMM's tiles but for BLOCK_N: the kernel's strips are the heads' halves
    cfg = {key: value for key, value in decode_matmul_config(x.dtype, num_rows).items()
           if key != "BLOCK_N"}
    assert hidden % cfg["BLOCK_K"] == 0, (hidden, cfg)
    if q_out is None:
        q_out = torch.empty(num_rows, num_heads, head_dim, dtype=x.dtype, device=x.device)
    assert q_out.shape == (num_rows, num_heads, head_dim) and q_out.dtype == x.dtype
    assert q_out.is_contiguous()
    if num_rows == 0:
        return q_out
    grid = (num_heads + 2 * num_kv_heads, triton.cdiv(num_rows, cfg["BLOCK_M"]))
    _qkv_norm_rope_kernel[grid](
        x, w, q_out, k_cache, v_cache, q_weight, k_weight, positions, cos_sin_cache,
        slot_mapping, num_rows, eps, x.stride(0), q_out.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), cos_sin_cache.stride(0), K=hidden,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, PAGE_SIZE=block_size,
        **prefetch_args(w, hidden), **cfg, **launch_options(x.device, num_rows))
    return q_out


def qkv_norm_rope_ref(x: torch.Tensor, w: torch.Tensor, num_heads: int, num_kv_heads: int,
                      positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """What the layers run otherwise: the GEMM (torch), then qk_norm_rope_store's reference."""
    head_dim = q_weight.shape[0]
    q, k, v = torch.nn.functional.linear(x, w).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return qk_norm_rope_store_ref(
        positions, q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim), q_weight, k_weight, eps, cos_sin_cache, k_cache,
        v_cache, slot_mapping)
