"""qkv_proj with Qwen3's attention prologue in its epilogue, for prompt steps: y = x @ w.T on
the TMA GEMM (tma_matmul.py's main loop), then per-head RMSNorm of q and k, neox-style RoPE,
q written out and k and v stored at their slots of the paged KV cache (qk_norm_rope.py's work).

Why: in a 16k-token prompt step of Qwen3-0.6B, cuBLAS writes the [rows, 4096] projection and
qk_norm_rope_store then reads it back and writes q, k and v again, ~67 us a layer at about its
bytes (bench/results/h200/profile-prefill-84f0c9d.log). Here each program owns one head's
column strip (head_dim = 2 x HALF columns, two HALF-wide accumulators: RoPE pairs column i with
i + HALF) for BLOCK_M rows, so the norm and the rotation run on the accumulators and nothing
goes back through memory. Rounding follows the unfused path: the projection rounds to the
activation dtype, then qk_norm_rope.norm_rotate.

The reference, tma_qkv_norm_rope_store_ref, is the unfused path: cuBLAS, then
qk_norm_rope_store_ref.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.qk_norm_rope import (check_prologue_args, norm_rotate,
                                            qk_norm_rope_store_ref)
from dataplane.kernels.sizes import cdiv
from dataplane.kernels.tma_matmul import (PREFILL_GROUPED_ABOVE, PREFILL_MIN_ROWS,
                                          TensorDescriptor, program_tile)


@triton.jit(do_not_specialize=["num_rows"])
def _tma_qkv_kernel(
    x_desc, w_desc, q_desc, k_cache_ptr, v_cache_ptr, q_weight_ptr, k_weight_ptr, positions_ptr,
    cos_sin_ptr, slot_mapping_ptr, num_rows, eps,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_cos_sin_pos,
    K: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    pid_m, pid_n = program_tile(GROUP_M)
    head = pid_n * HEADS_PER_PROGRAM  # q heads, then k heads, then v heads
    off_m = pid_m * BLOCK_M
    off_n = head * 2 * HALF
    acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)  # the head's first half of columns
    acc2 = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc3 = tl.zeros([BLOCK_M, HALF], tl.float32)  # the next head's, with two a program
    acc4 = tl.zeros([BLOCK_M, HALF], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K]
        acc1 = tl.dot(x, w_desc.load([off_n, k]).T, acc1)  # w tile: [HALF, BLOCK_K]
        acc2 = tl.dot(x, w_desc.load([off_n + HALF, k]).T, acc2)
        if HEADS_PER_PROGRAM == 2:
            acc3 = tl.dot(x, w_desc.load([off_n + 2 * HALF, k]).T, acc3)
            acc4 = tl.dot(x, w_desc.load([off_n + 3 * HALF, k]).T, acc4)
    args = (q_desc, k_cache_ptr, v_cache_ptr, q_weight_ptr, k_weight_ptr, positions_ptr,
            cos_sin_ptr, slot_mapping_ptr, num_rows, eps, stride_cache_block, stride_cache_tok,
            stride_cache_head, stride_cos_sin_pos, off_m)
    _head_epilogue(acc1, acc2, head, *args, NUM_HEADS, NUM_KV_HEADS, HALF, BLOCK_M, PAGE_SIZE)
    if HEADS_PER_PROGRAM == 2:
        _head_epilogue(acc3, acc4, head + 1, *args, NUM_HEADS, NUM_KV_HEADS, HALF, BLOCK_M,
                       PAGE_SIZE)


@triton.jit
def _head_epilogue(acc1, acc2, head, q_desc, k_cache_ptr, v_cache_ptr, q_weight_ptr,
                   k_weight_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr, num_rows, eps,
                   stride_cache_block, stride_cache_tok, stride_cache_head, stride_cos_sin_pos,
                   off_m, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """One head's columns [acc1 | acc2] of BLOCK_M rows from off_m: q normalized and rotated
    into q_desc, k normalized and rotated into the cache, v into the cache."""
    dtype = q_desc.dtype
    x1 = acc1.to(dtype).to(tl.float32)  # the projection's output, rounded as cuBLAS's is
    x2 = acc2.to(dtype).to(tl.float32)
    off_n = head * 2 * HALF
    rows = off_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HALF)[None, :]
    if head >= NUM_HEADS:  # k or v: stored at the rows' slots (negative: a padding row)
        slots = tl.load(slot_mapping_ptr + rows, mask=rows < num_rows, other=-1)
        kv_head = (head - NUM_HEADS) % NUM_KV_HEADS
        dst = ((slots // PAGE_SIZE) * stride_cache_block + (slots % PAGE_SIZE) * stride_cache_tok
               + kv_head * stride_cache_head)[:, None] + dims  # [BLOCK_M, HALF]
        is_stored = (slots >= 0)[:, None]
        if head >= NUM_HEADS + NUM_KV_HEADS:  # v as projected
            tl.store(v_cache_ptr + dst, x1.to(dtype), mask=is_stored)
            tl.store(v_cache_ptr + dst + HALF, x2.to(dtype), mask=is_stored)
        else:
            o1, o2 = _norm_rotate_rows(x1, x2, k_weight_ptr, positions_ptr, cos_sin_ptr, rows,
                                       num_rows, eps, stride_cos_sin_pos, dtype, HALF)
            tl.store(k_cache_ptr + dst, o1.to(dtype), mask=is_stored)
            tl.store(k_cache_ptr + dst + HALF, o2.to(dtype), mask=is_stored)
    else:
        o1, o2 = _norm_rotate_rows(x1, x2, q_weight_ptr, positions_ptr, cos_sin_ptr, rows,
                                   num_rows, eps, stride_cos_sin_pos, dtype, HALF)
        q_desc.store([off_m, off_n], o1.to(dtype))  # rows past num_rows are not written
        q_desc.store([off_m, off_n + HALF], o2.to(dtype))


@triton.jit
def _norm_rotate_rows(x1, x2, weight_ptr, positions_ptr, cos_sin_ptr, rows, num_rows, eps,
                      stride_cos_sin_pos, dtype: tl.constexpr, HALF: tl.constexpr):
    """norm_rotate of one head's halves at `rows`, each at its token's position."""
    dims = tl.arange(0, HALF)
    w1 = tl.load(weight_ptr + dims).to(tl.float32)[None, :]  # [1, HALF]
    w2 = tl.load(weight_ptr + HALF + dims).to(tl.float32)[None, :]
    pos = tl.load(positions_ptr + rows, mask=rows < num_rows, other=0)
    cos_sin = cos_sin_ptr + pos[:, None] * stride_cos_sin_pos + dims[None, :]
    cos = tl.load(cos_sin)  # [BLOCK_M, HALF]
    sin = tl.load(cos_sin + HALF)
    return norm_rotate(x1, x2, w1, w2, cos, sin, eps, dtype, HALF)


# Tiles: to be chosen on an H100/H200 by bench/tma_gemm_probe.py --prefill-qkv; a 128-row tile
# of one head (two 128 x 64 float32 sums) over two warpgroups to start.
_CONFIG = dict(BLOCK_M=128, BLOCK_K=64, num_stages=3, num_warps=8, GROUP_M=0,
               HEADS_PER_PROGRAM=2)
_GROUPED_CONFIG = _CONFIG | dict(GROUP_M=8)


def tma_qkv_config(num_rows: int) -> dict:
    """The kernel settings for num_rows rows (shared: copy before changing)."""
    return _GROUPED_CONFIG if num_rows > PREFILL_GROUPED_ABOVE else _CONFIG


def tma_qkv_pays(x: torch.Tensor, w: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
    """Whether qkv_proj of x [num_rows, K] by w [N, K] (no bias) with its prologue in the
    epilogue beats cuBLAS + qk_norm_rope_store, and TMA can read x: a prompt step's rows
    (tma_matmul.PREFILL_MIN_ROWS and more) on a CUDA device of compute capability 9 or later,
    16-bit floats, 16-byte aligned rows, heads of 2 x 16-128 columns (as many in each program),
    and a Triton with host-side TMA descriptors."""
    num_rows, k = x.shape
    per_program = tma_qkv_config(num_rows)["HEADS_PER_PROGRAM"]
    return (TensorDescriptor is not None and num_rows >= PREFILL_MIN_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda
            and torch.cuda.get_device_capability(x.device)[0] >= 9
            and x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0
            and 32 <= head_dim <= 256 and w.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim
            and num_heads % per_program == 0 and num_kv_heads % per_program == 0
            and k % tma_qkv_config(num_rows)["BLOCK_K"] == 0)


def tma_qkv_norm_rope_store(x: torch.Tensor, w: torch.Tensor, num_heads: int,
                            positions: torch.Tensor, q_weight: torch.Tensor,
                            k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, q_out: torch.Tensor | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """x: [num_tokens, K] (rows may be strided), w: [(num_heads + 2 num_kv_heads) head_dim, K]
    contiguous (q's rows, then k's, then v's), both bf16 or fp16; the rest as
    qk_norm_rope_store takes it, head_dim and num_kv_heads from k_cache. Writes the normalized,
    rotated k and the projected v at their slots; returns the normalized, rotated q
    [num_tokens, num_heads, head_dim] in q_out or a new tensor. config: over tma_qkv_config's
    choice (BLOCK_M, BLOCK_K, num_stages, num_warps, GROUP_M, HEADS_PER_PROGRAM: 1, or 2 where
    num_heads and num_kv_heads are even)."""
    assert x.dtype in (torch.bfloat16, torch.float16), x.dtype
    num_rows, k = x.shape
    num_kv_heads, head_dim = k_cache.shape[2:]
    assert w.shape == ((num_heads + 2 * num_kv_heads) * head_dim, k) and w.is_contiguous()
    assert x.dtype == w.dtype and x.stride(1) == 1
    q_out = check_prologue_args((num_rows, num_heads, head_dim), num_kv_heads, x.dtype, positions,
                                q_weight, k_weight, cos_sin_cache, k_cache, v_cache,
                                slot_mapping, q_out)
    cfg = tma_qkv_config(num_rows) | (config or {})
    bm, bk, half = cfg["BLOCK_M"], cfg["BLOCK_K"], head_dim // 2
    per_program = cfg["HEADS_PER_PROGRAM"]
    assert num_heads % per_program == 0 and num_kv_heads % per_program == 0, (
        "a program's heads are all q, all k or all v")
    assert k % bk == 0, (k, cfg)
    if num_rows == 0:
        return q_out
    x_desc = TensorDescriptor(x, [num_rows, k], [x.stride(0), 1], [bm, bk])
    w_desc = TensorDescriptor(w, list(w.shape), [k, 1], [half, bk])
    q_flat = q_out.view(num_rows, num_heads * head_dim)
    q_desc = TensorDescriptor(q_flat, list(q_flat.shape), [q_flat.stride(0), 1], [bm, half])
    grid = (cdiv(num_rows, bm), (num_heads + 2 * num_kv_heads) // per_program)
    _tma_qkv_kernel[grid](
        x_desc, w_desc, q_desc, k_cache, v_cache, q_weight, k_weight, positions, cos_sin_cache,
        slot_mapping, num_rows, eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        cos_sin_cache.stride(0), K=k, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        HEADS_PER_PROGRAM=per_program, BLOCK_M=bm, BLOCK_K=bk, NUM_STAGES=cfg["num_stages"],
        GROUP_M=cfg["GROUP_M"], PAGE_SIZE=k_cache.shape[1], num_warps=cfg["num_warps"])
    return q_out


def tma_qkv_norm_rope_store_ref(x: torch.Tensor, w: torch.Tensor, num_heads: int,
                                positions: torch.Tensor, q_weight: torch.Tensor,
                                k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_mapping: torch.Tensor) -> torch.Tensor:
    """The unfused path: the projection (rounded to x's dtype), then qk_norm_rope_store_ref."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    qkv = torch.nn.functional.linear(x, w)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return qk_norm_rope_store_ref(
        positions, q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim), q_weight, k_weight, eps, cos_sin_cache, k_cache,
        v_cache, slot_mapping)
