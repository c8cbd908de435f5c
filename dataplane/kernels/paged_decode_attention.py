"""Paged attention for decode: one query token per request, GQA, split-KV (flash-decoding).

One program handles one (kv head, request, split): the GROUP query heads that share the kv head
are stacked as the rows of one tile (padded to 16 for tl.dot), so each K/V tile is read from HBM
once per kv head, not once per query head. The kv head is the grid's fastest axis: a request's
heads run side by side and read the same cache pages together (1-3% faster on the H200 at
128-256 requests than request-fastest, with the same tiles). Long contexts are cut into
`num_splits` contiguous ranges of key tiles; each split writes its normalized partial output
and its log-sum-exp, and a second kernel combines them. With one split the first kernel writes
the output directly.

The split ranges are computed on the device from seq_lens, so one launch configuration (grid =
[num_kv_heads, num_reqs, num_splits]) serves any lengths: the launch is CUDA-graph capturable
(no host sync, no value read back). A request with seq_len 0 (a padding row) writes zeros.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from dataplane.kernels.paged_inputs import check_paged_attention_inputs

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed costs outweigh the parallelism it adds
MAX_SPLITS = 64  # also the combine kernel's one tile height (masked): a height per split count
# would compile a variant in the first eager step (a mixed step's decodes) that needs it


# The block-table row stride is the longest request's block count in an eager step: specialized,
# its values would compile variants inside served steps (graphs fix it at capture).
@triton.jit(do_not_specialize=["num_heads", "num_splits", "stride_bt_req"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, num_heads, num_splits,
    stride_q_tok, stride_q_head,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt_req, stride_out_tok, stride_out_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    req = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + req * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_mask = keys < seq_len
        blocks = tl.load(bt_row + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        offs = (blocks * stride_cache_block + (keys % PAGE_SIZE) * stride_cache_tok
                + kv_head * stride_cache_head)  # [BLOCK_N]
        k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        s = tl.where(key_mask[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # an empty split or request: zeros
    if not IS_SPLIT:
        dst = out_ptr + req * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part = (req * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_mask[:, None])
        tl.store(part_lse_ptr + part, m + tl.log2(l), mask=row_mask)  # -inf when empty


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, stride_out_tok, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    part = (req * num_heads + head) * num_splits + splits  # [BLOCK_SPLITS]
    lse = tl.load(part_lse_ptr + part, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lse_max))
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits < num_splits)[:, None], other=0.0)  # [BLOCK_SPLITS, HEAD_DIM]
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + req * stride_out_tok + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the split logic
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int,
                    device: torch.device) -> int:
    """Splits per request so that the grid covers the GPU a few times over: batches large enough
    to fill it on their own get one split; a single long request gets many. Static for a given
    (batch, max_seq_len), so CUDA graphs capture it with the bound they are captured for."""
    programs = max(1, num_reqs * num_kv_heads)
    wanted = -(-4 * _num_sms(device) // programs)
    useful = -(-max(1, max_seq_len) // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def _config(dtype: torch.dtype, head_dim: int) -> dict:
    if dtype == torch.float32:  # tests only: exact fp32 dots, tiles small enough for shared memory
        return dict(BLOCK_N=16, DOT_PRECISION="ieee", num_warps=4, num_stages=2)
    # Measured on the H200 (bench/tune_decode.py, bench/results/h200/decode_tuning.json): 128-key
    # tiles in two stages beat 64 in three by 3-5% at 128-256 requests of varied lengths; at 64
    # repeated timings of one config differ more than the configs do.
    return dict(BLOCK_N=128 if head_dim <= 128 else 64, DOT_PRECISION="tf32", num_warps=4,
                num_stages=2)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """q: [num_reqs, num_heads, head_dim], the one new token of each request (its k/v already
    stored); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32, cached tokens
    including the new one. num_splits: static split count, else picked from max_seq_len (a host
    bound; the block-table width when absent). config: tile settings over the defaults (BLOCK_N,
    num_warps, num_stages), for tuning. Returns out: [num_reqs, num_heads, head_dim]."""
    num_reqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    check_paged_attention_inputs(q, k_cache, v_cache)
    assert seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_reqs == 0:
        return out
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = pick_num_splits(num_reqs, num_kv_heads, bound, q.device)
    assert 1 <= num_splits <= 1024
    group = num_heads // num_kv_heads
    if num_splits > 1:
        part_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(num_kv_heads, num_reqs, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E, num_heads, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=block_size, IS_SPLIT=num_splits > 1,
        **(_config(q.dtype, head_dim) | (config or {})),
    )
    if num_splits > 1:
        _combine_kernel[(num_reqs, num_heads)](
            part_out, part_lse, out, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_SPLITS=max(MAX_SPLITS, triton.next_power_of_2(num_splits)),
            num_warps=4,
        )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Float32 gather + softmax per request; zeros for seq_len 0."""
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        blocks = block_tables[i, :math.ceil(seq_len / block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].float()  # [seq_len, kv_heads, d]
        values = v_cache[blocks].flatten(0, 1)[:seq_len].float()
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [seq_len, heads, d]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].float(), keys) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values).to(q.dtype)
    return out
