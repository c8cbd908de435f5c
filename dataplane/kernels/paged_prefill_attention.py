"""Causal attention for variable-length queries over the paged KV cache (prefill, chunked prefill,
prefill after a prefix-cache hit, and batches that mix those with decodes).

Each request r has q_len = query_start_loc[r+1] - query_start_loc[r] new tokens, already stored
in the cache, after seq_len - q_len cached ones; its query i sits at position seq_len - q_len + i
and sees keys 0..that position. All keys are read from the cache through the block table.

One program handles BLOCK_Q consecutive queries of one request for the GROUP query heads of one
kv head, stacked as BLOCK_M = BLOCK_Q * GROUP_P rows (row = query * GROUP_P + head), so each K/V
tile is loaded once per kv head. Two grids:
- last-first: (num_reqs, query tiles of the longest request, num_kv_heads), the second index
  counting a request's query tiles from its last. The hardware starts a grid's programs in
  order, first index fastest, so a kv head's programs run every request's last tile first and
  end on the lightest tiles; programs past a request's tiles return at once.
- searched: (num_tokens // BLOCK_Q + num_reqs, num_kv_heads). With t = query_start_loc[r] -
  first_token (first_token: where this launch's tokens start), request r owns the programs
  [t // BLOCK_Q + r, t' // BLOCK_Q + r + 1) (t' for r + 1), each request's tiles first to last,
  found by a binary search over query_start_loc.
Last-first took ~2% off workload A's prompt step and 1.5-6% off long prompts
(bench/results/h200/prefill_variants-c3b90bd.json, -7e587ce.json) and is the default; a launch
whose last-first grid would be mostly programs that return (a few long requests among many
short ones) takes the searched grid.
"""

import math

import torch
import triton
import triton.language as tl

from dataplane.kernels.paged_inputs import PagedLaunch, check_paged_attention_inputs
from dataplane.kernels.sizes import cdiv, next_power_of_2

LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, program, num_reqs, first_token, BLOCK_Q: tl.constexpr):
    """The last request r with (query_start_loc[r] - first_token) // BLOCK_Q + r <= program
    (increasing in r)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + mid) - first_token) // BLOCK_Q + mid
        lo = tl.where(first <= program, mid, lo)
        hi = tl.where(first <= program, hi, mid)
    return lo


@triton.jit
def _attend_tiles(acc, m, l, q, k_cache_ptr, v_cache_ptr, bt_row, kv_offset, q_pos, seq_len,
                  tile_lo, tile_hi, scale_log2e, stride_cache_block, stride_cache_tok,
                  HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over key tiles [tile_lo, tile_hi); MASKED applies the causal and length
    masks (the tiles before the diagonal need neither)."""
    dims = tl.arange(0, HEAD_DIM)
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            key_mask = keys < seq_len
            blocks = tl.load(bt_row + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        else:
            blocks = tl.load(bt_row + keys // PAGE_SIZE).to(tl.int64)
        offs = blocks * stride_cache_block + (keys % PAGE_SIZE) * stride_cache_tok + kv_offset
        if MASKED:
            k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=key_mask[:, None],
                        other=0.0)
            v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=key_mask[:, None],
                        other=0.0)
        else:
            k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :])
            v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        if MASKED:
            visible = (keys[None, :] <= q_pos[:, None]) & key_mask[None, :]
            s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return acc, m, l


# Not specialized on the request count, the first token, the block-table row stride (the
# longest request's block count in a step) or the alignment of the per-request arrays (slices
# [d:] of them after d decodes): every value would otherwise be one of two or three variants,
# and a variant first seen inside a served step compiles there (found on the H200: one such
# compile per run).
@triton.jit(do_not_specialize=["num_reqs", "first_token", "stride_bt_req", "block_tables_ptr",
                               "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    num_reqs, first_token, scale_log2e,
    stride_q_tok, stride_q_head, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt_req, stride_out_tok, stride_out_head,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, LAST_TILES_FIRST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if LAST_TILES_FIRST:  # grid (num_reqs, query tiles of the longest request, num_kv_heads)
        req = tl.program_id(0)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + req)  # with the two above: one round trip, not two
        q_start -= first_token  # an index into this launch's q and out
        q_tile = tl.cdiv(q_len, BLOCK_Q) - 1 - tl.program_id(1)
        if q_tile < 0:
            return
    else:  # grid (num_tokens // BLOCK_Q + num_reqs, num_kv_heads)
        program = tl.program_id(0)
        kv_head = tl.program_id(1)
        req = _find_request(query_start_loc_ptr, program, num_reqs, first_token, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        q_start -= first_token
        q_tile = program - (q_start // BLOCK_Q + req)
        if q_tile * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    query = q_tile * BLOCK_Q + rows // GROUP_P  # index among this request's new tokens
    head_in_group = rows % GROUP_P
    row_mask = (query < q_len) & (head_in_group < GROUP)
    heads = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM)
    tokens = (q_start + query).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q_tok + heads[:, None] * stride_q_head
                + dims[None, :], mask=row_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    q_pos = num_cached + query  # [BLOCK_M]

    # Every row sees keys 0..first_pos; the tile's last query sees up to key_end - 1.
    first_pos = num_cached + q_tile * BLOCK_Q
    key_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    # Keys before the first row's position need no mask. (Masking them too, so that one
    # pipeline runs to the diagonal, was 2-5% faster on prompts of 128-256 tokens, 0.4-2%
    # slower at 512 and on workload A's step, 15-16% slower on long prompts.)
    num_full_tiles = (first_pos + 1) // BLOCK_N
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    kv_offset = kv_head * stride_cache_head
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m, l = _attend_tiles(acc, m, l, q, k_cache_ptr, v_cache_ptr, bt_row, kv_offset, q_pos,
                              seq_len, 0, num_full_tiles, scale_log2e, stride_cache_block,
                              stride_cache_tok, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION)
    acc, m, l = _attend_tiles(acc, m, l, q, k_cache_ptr, v_cache_ptr, bt_row, kv_offset, q_pos,
                              seq_len, num_full_tiles, tl.cdiv(key_end, BLOCK_N), scale_log2e,
                              stride_cache_block, stride_cache_tok, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                              True, DOT_PRECISION)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    dst = (out_ptr + tokens[:, None] * stride_out_tok + heads[:, None] * stride_out_head
           + dims[None, :])
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


# The longest query a step may have for 64-row tiles: on workload A's prompt steps (16k tokens
# of prompts of 100-1024) 64 rows, 32-key tiles, 4 warps and 2 stages took 219 us against 275
# for the earlier 128 / 64 / 8 / 3 (Qwen3-0.6B heads; 8B: 389 against 488;
# tune_prefill-789baa0.json). Longer prompts keep 128 rows, with 32-key tiles and 4 warps: 2-9%
# under 128 / 64 / 8 / 3 on two prompts of 8192 and on 2048-token chunks after 4096 cached
# tokens, within 4% of the best there (tune_prefill-0e8014c.json).
SMALL_TILES_MAX_QUERY = 1024
# With the last-first grid, 3 stages beat 2 on workload A's steps (0.6B heads: 210 against 215
# us, twice; 8B: 381 against 383-384) and on 512-token prompts at 0.6B heads (1%; a tie at 8B),
# and lose 1-3% at 128-256 (prefill_variants-c3b90bd.json, -7e587ce.json).
THREE_STAGES_MIN_QUERY = 512
# The last-first grid has num_reqs x (the longest request's query tiles) programs a kv head, the
# searched one about num_tokens / BLOCK_Q + num_reqs: on workload A's steps 1.7 times as many.
# Past this ratio the launch takes the searched grid. (Not measured: what the programs that
# return at once cost when they are most of a launch.)
LAST_TILES_FIRST_MAX_GRID_RATIO = 2


def _config(dtype: torch.dtype, head_dim: int, group_p: int, max_query_len: int) -> dict:
    """Tile sizes: 128 query rows for long prompts (Hopper wgmma needs M >= 64 per warpgroup),
    64 up to SMALL_TILES_MAX_QUERY, fewer when every request brings only a few tokens (chunk
    tails, decodes)."""
    if dtype == torch.float32:  # tests only: exact fp32 dots, tiles small enough for shared memory
        block_m = min(32, max(16, next_power_of_2(max_query_len * group_p)))
        return dict(BLOCK_Q=max(1, block_m // group_p), BLOCK_N=16, DOT_PRECISION="ieee",
                    num_warps=4, num_stages=2)
    small = max_query_len <= SMALL_TILES_MAX_QUERY
    block_m = min(64 if small else 128, max(16, next_power_of_2(max_query_len * group_p)))
    three_stages = max_query_len >= THREE_STAGES_MIN_QUERY and head_dim <= 128
    return dict(BLOCK_Q=max(1, block_m // group_p), BLOCK_N=32, DOT_PRECISION="tf32",
                num_warps=4, num_stages=3 if three_stages else 2)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, max_query_len: int | None = None,
                            out: torch.Tensor | None = None, config: dict | None = None,
                            first_token: int = 0) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (their k/v already stored); k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]; the rest as for
    `prepare_prefill_attention`. Returns out: [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q) if out is None else out
    launch = prepare_prefill_attention(q, k_cache, v_cache, out, block_tables, query_start_loc,
                                       seq_lens, scale, max_query_len, config, first_token)
    return out if launch is None else launch(q, k_cache, v_cache, out)


def prepare_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              out: torch.Tensor, block_tables: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              max_query_len: int | None = None, config: dict | None = None,
                              first_token: int = 0) -> PagedLaunch | None:
    """The launch for every layer whose q, caches and out are laid out as these
    (paged_prefill_attention's shapes); None when there is nothing to attend.
    block_tables: [num_reqs, max_blocks] int32; query_start_loc: [num_reqs + 1] int32;
    seq_lens: [num_reqs] int32 (cached + new); max_query_len: a host bound on the query
    lengths, at least the longest (picks the tile size and the grid; default num_tokens).
    first_token: the value query_start_loc starts at (on the host), e.g. d for the slice [d:] of
    a step's offsets whose first d one-token requests are served elsewhere; q and out then are
    the matching slices [d:] of the step's tokens.
    config: settings over the defaults (BLOCK_Q, BLOCK_N, num_warps, num_stages, and
    LAST_TILES_FIRST: which grid), for tuning and tests."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_reqs = seq_lens.shape[0]
    check_paged_attention_inputs(q, k_cache, v_cache)
    assert query_start_loc.shape == (num_reqs + 1,) and query_start_loc.dtype == torch.int32
    assert seq_lens.dtype == torch.int32 and block_tables.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs
    assert block_tables.stride(1) == 1
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    assert first_token >= 0
    if num_tokens == 0 or num_reqs == 0:
        return None
    group = num_heads // num_kv_heads
    group_p = next_power_of_2(group)
    max_query_len = max_query_len or num_tokens
    config = _config(q.dtype, head_dim, group_p, max_query_len) | (config or {})
    num_q_tiles = cdiv(max_query_len, config["BLOCK_Q"])
    num_searched = num_tokens // config["BLOCK_Q"] + num_reqs
    if "LAST_TILES_FIRST" not in config:
        config["LAST_TILES_FIRST"] = num_q_tiles <= 65535 and (
            num_reqs * num_q_tiles <= LAST_TILES_FIRST_MAX_GRID_RATIO * num_searched)
    if config["LAST_TILES_FIRST"]:
        assert num_q_tiles <= 65535, "a grid's second dimension holds 65535 programs at most"
        grid = (num_reqs, num_q_tiles, num_kv_heads)
    else:
        grid = (num_searched, num_kv_heads)
    rest = (block_tables, query_start_loc, seq_lens, num_reqs, first_token, scale * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1))
    constexprs = dict(GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, PAGE_SIZE=block_size,
                      **config)
    return PagedLaunch.prepare(_prefill_kernel, grid, q, k_cache, out, rest, constexprs)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 gather + causally masked softmax per request."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        blocks = block_tables[i, :math.ceil(seq_len / block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        values = v_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))  # [heads, q_len, seq_len]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out
