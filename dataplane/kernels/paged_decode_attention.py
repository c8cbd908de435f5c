"""Paged attention for decode: one query token per request, GQA, as a persistent kernel over one
flat list of key tiles (the lean-attention / stream-K schedule).

Every request's cached keys are cut into BLOCK_N-key tiles, and the tiles of all requests, in
request order, form one list: the step's *plan*, built on the device once per forward by
`plan_decode` (each tile's request, valid key count, first/last flags and block ids: no larger
than the block tables). For each kv head a fixed number of programs, as many as the GPU holds at
once, take equal contiguous ranges of that list and walk them in one software-pipelined loop:
every program moves about the same bytes (no wave of short programs waiting for a long one), and
a program goes from one request to the next without a start-up chain (seq_len -> block ids ->
first tile). The GROUP query heads that share a kv head are the rows of one tile (padded to 16
for tl.dot): each K/V tile is read from HBM once per kv head.

A request wholly inside one program's range is written directly. A request cut by a range
boundary leaves one normalized partial output and log-sum-exp per piece; the program that
finishes its last piece (an atomic counter per (kv head, request)) merges them and resets the
counter. A request with seq_len 0 (a padding row) is one empty tile and writes zeros.

The plan and the launch depend only on the batch size and the block-table width, never on the
lengths: a CUDA graph captures them once (nothing is read back on the host).

On the H200 (bench/results/h200/decode_tuning-4c056b3.json) it moves workload A's decode
batches at 88-91% of the copy bandwidth at 128-256 requests, 78% at 64 and 60% at 32, against
85-89%, 71% and 55% for the split-KV kernel it replaced (decode_order-75f96e5.json). A plan of
per-key cache slots (5883bf3) ran the same; the per-page block ids need 1/16 of its memory.
Leaving the list's last 1-6% to chunks that programs claim from a counter as they finish
(dynamic balancing of the 4-9 us between the median and the last program's end; 02603d6) lost
at 8-128 rows and gained about 1 us at 256 (decode_claims-02603d6.json): a claimed chunk
restarts the pipeline and adds merges, which cost more than the spread they remove.
"""

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dataplane.kernels.paged_inputs import PagedLaunch, check_paged_attention_inputs
from dataplane.kernels.pdl import launch_options, wait_for_inputs
from dataplane.kernels.sizes import next_power_of_2

LOG2E = 1.4426950408889634
MAX_PROGRAMS_PER_SM = 8  # bounds the partial-output scratch a plan allocates
PLAN_CHUNK = 128  # ids the plan kernel moves per vector op
TRACE_COLUMNS = 10  # a traced program's record: 4 x (timer, cycles), its SM's id, unused
_TRACE_COLUMNS = tl.constexpr(TRACE_COLUMNS)
# tile_info's bits above the valid key count (bits 0-15): first tile, last tile, page offset
_FIRST, _LAST, _OFFSET = tl.constexpr(16), tl.constexpr(17), tl.constexpr(18)


@triton.jit(do_not_specialize=["num_reqs", "num_kv_heads", "stride_bt_req"])
def _plan_kernel(
    seq_lens_ptr, block_tables_ptr, num_reqs, num_kv_heads, stride_bt_req,
    tile_req_ptr, tile_info_ptr, tile_blocks_ptr, req_tile_start_ptr, counters_ptr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr,
    CHUNK: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.zeros([], tl.int32)  # this request's first tile: one or more per earlier request
    for lo in range(0, req, CHUNK):
        idx = lo + tl.arange(0, CHUNK)
        lens = tl.load(seq_lens_ptr + idx, mask=idx < req, other=0)
        start += tl.sum(tl.where(idx < req, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0), 0)
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.maximum(tl.cdiv(seq_len, BLOCK_N), 1)
    tl.store(req_tile_start_ptr + req, start)
    if req == num_reqs - 1:
        tl.store(req_tile_start_ptr + num_reqs, start + num_tiles)  # the list's length
    for head in range(0, num_kv_heads):
        tl.store(counters_ptr + head * num_reqs + req, 0)

    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    num_pages = tl.cdiv(seq_len, PAGE_SIZE)
    for lo in range(0, num_tiles * TILE_PAGES, CHUNK):
        idx = lo + tl.arange(0, CHUNK)  # [CHUNK]: tile idx // TILE_PAGES, its page idx % ...
        page = (idx // TILE_PAGES) * BLOCK_N // PAGE_SIZE + idx % TILE_PAGES
        ids = tl.load(bt_row + page, mask=page < num_pages, other=0)
        tl.store(tile_blocks_ptr + start * TILE_PAGES + idx, ids,
                 mask=idx < num_tiles * TILE_PAGES)
    for lo in range(0, num_tiles, CHUNK):
        tile = lo + tl.arange(0, CHUNK)
        valid = tl.minimum(tl.maximum(seq_len - tile * BLOCK_N, 0), BLOCK_N)
        info = (valid | ((tile == 0).to(tl.int32) << _FIRST)
                | ((tile == num_tiles - 1).to(tl.int32) << _LAST)
                | (((tile * BLOCK_N) % PAGE_SIZE) << _OFFSET))
        tl.store(tile_info_ptr + start + tile, info, mask=tile < num_tiles)
        tl.store(tile_req_ptr + start + tile, tile * 0 + req, mask=tile < num_tiles)


@triton.jit
def _stamp(trace_ptr, record, point, after):
    """For TRACE: the global nanosecond timer and the SM's cycle counter at trace[record, point],
    and at point 0 the SM's id in the record's column 8. The reads wait for `after` (an int32
    scalar) and keep their place in program order (the asm is not pure), so a stamp after the
    tile loop follows the stores the loop issued."""
    timer = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after],
                                      dtype=tl.int64, is_pure=False, pack=1)
    cycles = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [after],
                                       dtype=tl.int64, is_pure=False, pack=1)
    tl.store(trace_ptr + record * _TRACE_COLUMNS + point * 2, timer)
    tl.store(trace_ptr + record * _TRACE_COLUMNS + point * 2 + 1, cycles)
    if point == 0:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [after], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(trace_ptr + record * _TRACE_COLUMNS + 8, sm.to(tl.int64))


@triton.jit
def _piece(kv_head, prog, slot, num_progs, GROUP: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows of the partial buffers for one program's piece: slot 0 holds the piece of the
    request its range starts in, slot 1 that of the request it ends in."""
    return ((kv_head * num_progs + prog) * 2 + slot) * GROUP + tl.arange(0, BLOCK_H)


@triton.jit
def _merge_pieces(
    req, kv_head, total, active, num_progs, num_reqs, out_ptr, req_tile_start_ptr, counters_ptr,
    part_out_ptr, part_lse_ptr, stride_out_tok, stride_out_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Count this program's piece of `req` in; the program that brings the last piece merges
    every piece (its own included) into the output and resets the counter."""
    first = tl.load(req_tile_start_ptr + req)
    end = tl.load(req_tile_start_ptr + req + 1)
    # the programs whose ranges hold the request's first and last tiles
    prog_lo = (((first + 1).to(tl.int64) * active - 1) // total).to(tl.int32)
    prog_hi = ((end.to(tl.int64) * active - 1) // total).to(tl.int32)
    counter = counters_ptr + kv_head * num_reqs + req
    tl.debug_barrier()  # every thread's partial stores issued before the release below
    count = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if count == prog_hi - prog_lo:
        rows = tl.arange(0, BLOCK_H)
        row_mask = rows < GROUP
        dims = tl.arange(0, HEAD_DIM)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        weight = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for prog in range(prog_lo, prog_hi + 1):
            range_start = (prog_lo.to(tl.int64) * total // active).to(tl.int32)
            slot = ((prog == prog_lo) & (first > range_start)).to(tl.int32)
            piece = _piece(kv_head, prog, slot, num_progs, GROUP, BLOCK_H)
            lse = tl.load(part_lse_ptr + piece, mask=row_mask, other=float("-inf"),
                          cache_modifier=".cg")
            part = tl.load(part_out_ptr + piece[:, None] * HEAD_DIM + dims[None, :],
                           mask=row_mask[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_ref)
            beta = tl.exp2(lse - m_ref)
            acc = acc * alpha[:, None] + part * beta[:, None]
            weight = weight * alpha + beta
            m = m_new
        out = acc / tl.where(weight == 0.0, 1.0, weight)[:, None]
        heads = kv_head * GROUP + rows
        tl.store(out_ptr + req * stride_out_tok + heads[:, None] * stride_out_head
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        tl.store(counter, 0)


@triton.jit
def _attend_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, tile_blocks_ptr, tile, req, info, kv_head, m, l, acc,
    scale_log2e, stride_q_tok, stride_q_head, stride_cache_block, stride_cache_tok,
    stride_cache_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_PAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One tile of request `req` into the running softmax state (m, l, acc) of the kv head's
    query rows. The pipeliner loads the next tile's block ids and K/V while this one computes."""
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, BLOCK_N)
    key_mask = keys < (info & 0xFFFF)
    if PAGE_SIZE > BLOCK_N:  # tiles start inside pages
        in_page = (info >> _OFFSET) + keys  # [BLOCK_N]
    else:  # tiles start at page starts: the block ids' address waits for no load
        in_page = keys
    blocks = tl.load(tile_blocks_ptr + tile * TILE_PAGES + in_page // PAGE_SIZE)
    offs = (blocks.to(tl.int64) * stride_cache_block + (in_page % PAGE_SIZE) * stride_cache_tok
            + kv_head * stride_cache_head)  # [BLOCK_N]
    q = tl.load(q_ptr + req.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
                + dims[None, :], mask=(rows < GROUP)[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]
    k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
    s = tl.where(key_mask[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty tile: no -inf - -inf
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _write_request(
    out_ptr, part_out_ptr, part_lse_ptr, m, l, acc, req, is_whole, slot, kv_head, prog,
    num_progs, stride_out_tok, stride_out_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """The end of a request in this range: its output when the range holds all of it, else this
    range's piece (normalized output and log-sum-exp) in the partial buffers at `slot`."""
    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    if is_whole:
        heads = kv_head * GROUP + rows
        dst = out_ptr + req * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:  # a piece of a request this range shares with its neighbours
        piece = _piece(kv_head, prog, slot, num_progs, GROUP, BLOCK_H)
        tl.store(part_out_ptr + piece[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=row_mask[:, None])
        tl.store(part_lse_ptr + piece, m + tl.log2(l), mask=row_mask)


@triton.jit(do_not_specialize=["num_reqs"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    tile_req_ptr, tile_info_ptr, tile_blocks_ptr, req_tile_start_ptr, counters_ptr,
    part_out_ptr, part_lse_ptr, trace_ptr, scale_log2e, num_reqs,
    stride_q_tok, stride_q_head, stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_out_tok, stride_out_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE_PAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TRACE: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    kv_head = tl.program_id(0)
    prog = tl.program_id(1)
    num_progs = tl.num_programs(1)
    record = kv_head * num_progs + prog
    if TRACE:
        _stamp(trace_ptr, record, 0, prog)
    total = tl.load(req_tile_start_ptr + num_reqs)
    active = tl.minimum(num_progs, total)  # every active program gets at least one tile
    if prog < active:
        tile_lo = (prog.to(tl.int64) * total // active).to(tl.int32)
        tile_hi = ((prog + 1).to(tl.int64) * total // active).to(tl.int32)
        first_req = tl.load(tile_req_ptr + tile_lo)
        if TRACE:
            _stamp(trace_ptr, record, 1, first_req)
        has_start = tl.zeros([], tl.int32)  # 1: the current request's first tile is in this range
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for tile in range(tile_lo, tile_hi):
            req = tl.load(tile_req_ptr + tile)
            info = tl.load(tile_info_ptr + tile)
            is_last = ((info >> _LAST) & 1) == 1
            has_start = tl.where(((info >> _FIRST) & 1) == 1, 1, has_start)
            m, l, acc = _attend_tile(
                q_ptr, k_cache_ptr, v_cache_ptr, tile_blocks_ptr, tile, req, info, kv_head, m, l,
                acc, scale_log2e, stride_q_tok, stride_q_head, stride_cache_block,
                stride_cache_tok, stride_cache_head, GROUP, BLOCK_H, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                TILE_PAGES, DOT_PRECISION)
            if is_last | (tile == tile_hi - 1):
                _write_request(out_ptr, part_out_ptr, part_lse_ptr, m, l, acc, req,
                               is_last & (has_start == 1), tl.where(req == first_req, 0, 1),
                               kv_head, prog, num_progs, stride_out_tok, stride_out_head,
                               GROUP, BLOCK_H, HEAD_DIM)
                m = tl.full([BLOCK_H], float("-inf"), tl.float32)
                l = tl.zeros([BLOCK_H], tl.float32)
                acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

        if TRACE:
            _stamp(trace_ptr, record, 2, tile_hi)
        first_info = tl.load(tile_info_ptr + tile_lo)
        last_req = tl.load(tile_req_ptr + tile_hi - 1)
        last_info = tl.load(tile_info_ptr + tile_hi - 1)
        is_first_cut = ((first_info >> _FIRST) & 1) == 0  # begun by an earlier range
        is_last_cut = ((last_info >> _LAST) & 1) == 0  # finished by a later range
        if is_first_cut:
            _merge_pieces(first_req, kv_head, total, active, num_progs, num_reqs, out_ptr,
                          req_tile_start_ptr, counters_ptr, part_out_ptr, part_lse_ptr,
                          stride_out_tok, stride_out_head, GROUP, BLOCK_H, HEAD_DIM)
        if is_last_cut & ((last_req != first_req) | (not is_first_cut)):
            _merge_pieces(last_req, kv_head, total, active, num_progs, num_reqs, out_ptr,
                          req_tile_start_ptr, counters_ptr, part_out_ptr, part_lse_ptr,
                          stride_out_tok, stride_out_head, GROUP, BLOCK_H, HEAD_DIM)
    if TRACE:
        _stamp(trace_ptr, record, 3, prog)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number exercises the cut requests
    return torch.cuda.get_device_properties(device).multi_processor_count


_resident_per_sm: dict[tuple, int] = {}  # compiled variant -> its programs one SM holds at once


def _programs_per_head(device: torch.device, num_kv_heads: int, cap: int, args: tuple,
                       constexprs: dict) -> int:
    """Programs per kv head that fill every SM once: as many as one SM holds of the compiled
    kernel (its shared memory, 1 KB of it reserved per program, registers, threads). More
    would run as a second, partial wave; fewer would leave bandwidth unused."""
    if device.type != "cuda":
        return max(1, min(cap, _num_sms(device) * 3 // num_kv_heads))
    key = (device, args[0].dtype, tuple(sorted(constexprs.items())))
    if key not in _resident_per_sm:
        compiled = _decode_kernel.warmup(*args, grid=(1, 1), **constexprs)  # compiles only
        compiled._init_handles()  # loads the binary, which gives its register count
        props = torch.cuda.get_device_properties(device)
        threads = props.warp_size * constexprs["num_warps"]
        _resident_per_sm[key] = max(1, min(
            props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024),
            65536 // (-(-compiled.n_regs // 8) * 8 * threads),  # 64K registers an SM (sm_70+)
            props.max_threads_per_multi_processor // threads))
    return max(1, min(cap, _num_sms(device) * _resident_per_sm[key] // num_kv_heads))


def _config(dtype: torch.dtype, head_dim: int) -> dict:
    if dtype == torch.float32:  # tests only: exact fp32 dots, tiles small enough for shared memory
        return dict(BLOCK_N=16, DOT_PRECISION="ieee", num_warps=4, num_stages=2)
    # Measured on the H200 (bench/tune_decode.py, decode_tuning-5883bf3.json): 128-key tiles in
    # two stages are the best or within 1% of it on every shape; 8 warps are 30-40% slower.
    return dict(BLOCK_N=128 if head_dim <= 128 else 64, DOT_PRECISION="tf32", num_warps=4,
                num_stages=2)


@dataclass
class DecodePlan:
    """The step's tile list and the scratch its launches share (one per forward, built by
    `plan_decode`, reused by every layer)."""

    num_reqs: int
    block_n: int
    # per kv head; None: as many as fill the GPU once, resolved (and kept) by the first launch
    num_programs: int | None
    max_programs: int  # per kv head, what the partial scratch holds
    tile_req: torch.Tensor  # [max_tiles] int32: the request of each tile
    tile_info: torch.Tensor  # [max_tiles] int32: valid keys | first, last flags | page offset
    tile_blocks: torch.Tensor  # [max_tiles * tile_pages] int32: each tile's block ids
    req_tile_start: torch.Tensor  # [num_reqs + 1] int32: first tile of each request; total
    counters: torch.Tensor  # [num_kv_heads, num_reqs] int32: pieces merged so far (zeros)
    # per (kv head, program, slot) of a launch's programs (max_programs bounds them)
    part_out: torch.Tensor  # [num_kv_heads * max_programs * 2 * group * head_dim] float32
    part_lse: torch.Tensor  # [num_kv_heads * max_programs * 2 * group] float32


def plan_decode(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, num_programs: int | None = None,
                block_n: int | None = None) -> DecodePlan:
    """Build the tile list of a decode batch on the device (one small launch). q: [num_reqs,
    num_heads, head_dim]; k_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32. num_programs: per kv
    head, default as many as fill the GPU once; block_n: keys a tile (the kernel's default)."""
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    assert seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_reqs
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    block_n = block_n or _config(q.dtype, head_dim)["BLOCK_N"]
    tile_pages = max(1, block_n // block_size)
    max_tiles = num_reqs * max(1, -(-block_tables.shape[1] * block_size // block_n))
    if num_programs is not None:
        num_programs = max(1, min(num_programs, max_tiles))
    max_programs = num_programs or max(1, _num_sms(q.device) * MAX_PROGRAMS_PER_SM // num_kv_heads)
    group = num_heads // num_kv_heads
    i32 = dict(dtype=torch.int32, device=q.device)
    plan = DecodePlan(
        num_reqs=num_reqs, block_n=block_n, num_programs=num_programs, max_programs=max_programs,
        tile_req=torch.empty(max_tiles, **i32), tile_info=torch.empty(max_tiles, **i32),
        tile_blocks=torch.empty(max_tiles * tile_pages, **i32),
        req_tile_start=torch.empty(num_reqs + 1, **i32),
        counters=torch.empty(num_kv_heads, num_reqs, **i32),
        part_out=torch.empty(num_kv_heads * max_programs * 2 * group * head_dim,
                             dtype=torch.float32, device=q.device),
        part_lse=torch.empty(num_kv_heads * max_programs * 2 * group, dtype=torch.float32,
                             device=q.device))
    if num_reqs:
        _plan_kernel[(num_reqs,)](
            seq_lens, block_tables, num_reqs, num_kv_heads, block_tables.stride(0),
            plan.tile_req, plan.tile_info, plan.tile_blocks, plan.req_tile_start, plan.counters,
            BLOCK_N=block_n, PAGE_SIZE=block_size, TILE_PAGES=tile_pages, CHUNK=PLAN_CHUNK,
            num_warps=4)
    return plan


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, plan: DecodePlan | None = None,
                           config: dict | None = None,
                           trace: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_reqs, num_heads, head_dim], the one new token of each request (its k/v already
    stored); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32, cached tokens
    including the new one. plan: this batch's `plan_decode`, built here from block_tables and
    seq_lens when absent (they are not read otherwise; a model builds one plan a forward).
    config, trace: as for `prepare_decode_attention`. Returns out: [num_reqs, num_heads,
    head_dim]."""
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] and plan is None:
        plan = plan_decode(q, k_cache, block_tables, seq_lens)
    launch = prepare_decode_attention(q, k_cache, v_cache, out, plan, scale, config, trace)
    return out if launch is None else launch(q, k_cache, v_cache, out)


def prepare_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             out: torch.Tensor, plan: DecodePlan | None, scale: float,
                             config: dict | None = None,
                             trace: torch.Tensor | None = None) -> PagedLaunch | None:
    """The launch of `plan`'s batch for every layer whose q, caches and out are laid out as
    these (paged_decode_attention's shapes); None when the batch is empty. config: kernel
    settings over the defaults (num_warps, num_stages), for tuning. trace: for probes,
    [num_kv_heads * num_programs, TRACE_COLUMNS] int64 zeros, filled with each program's global
    timer (ns) and cycle counter at its start, once its first request is known, after its tile
    loop and at its end (a program with no tiles writes only the first and last), then the id
    of the SM it ran on."""
    num_reqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    check_paged_attention_inputs(q, k_cache, v_cache)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_reqs == 0:
        return None
    assert plan is not None
    group = num_heads // num_kv_heads
    assert plan.num_reqs == num_reqs and plan.counters.shape == (num_kv_heads, num_reqs)
    assert plan.part_lse.numel() == num_kv_heads * plan.max_programs * 2 * group
    assert plan.part_out.numel() == plan.part_lse.numel() * head_dim
    assert plan.tile_req.device == q.device
    rest = (plan.tile_req, plan.tile_info, plan.tile_blocks,
            plan.req_tile_start, plan.counters, plan.part_out, plan.part_lse,
            plan.counters if trace is None else trace, scale * LOG2E,
            num_reqs, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), out.stride(0), out.stride(1))
    constexprs = dict(GROUP=group, BLOCK_H=max(16, next_power_of_2(group)),
                      HEAD_DIM=head_dim, PAGE_SIZE=block_size,
                      TILE_PAGES=max(1, plan.block_n // block_size),
                      TRACE=trace is not None,
                      **launch_options(q.device, num_reqs),
                      **(_config(q.dtype, head_dim) | (config or {}) | dict(BLOCK_N=plan.block_n)))
    if plan.num_programs is None:  # once a plan: the launches after the first reuse it
        plan.num_programs = _programs_per_head(q.device, num_kv_heads, plan.max_programs,
                                               (q, k_cache, v_cache, out, *rest), constexprs)
    if trace is not None:
        assert trace.shape == (num_kv_heads * plan.num_programs, TRACE_COLUMNS)
        assert trace.dtype == torch.int64
        assert trace.is_contiguous() and trace.device == q.device
    return PagedLaunch.prepare(_decode_kernel, (num_kv_heads, plan.num_programs), q, k_cache,
                               out, rest, constexprs)


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
