"""Fused mixture-of-experts: each token's top-k experts as two grouped GEMMs over sorted rows.

`fused_moe(x, w13, w2, topk_weights, topk_ids)` runs three kernels and one sum:

1. `_align_kernel` sorts the num_tokens * top_k (token, expert) pairs by expert and pads each
   expert's run to a multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted order belongs to
   one expert (`block_expert_ids`). Experts that receive no token get no tile.
2. `_gate_up_kernel`, one launch for all experts: per tile, x[tokens] @ w13[e].T for the gate and
   the up half at once (the x tile is loaded once for both), then silu(gate) * up, written in
   sorted order so the next kernel reads contiguous rows.
3. `_down_kernel`, one launch: act @ w2[e].T times the routing weight, scattered back to pair order.
4. The top_k rows of each token are summed (torch; deterministic, unlike atomics).

All sizes are upper bounds known on the host (no device sync), so the path can be captured in a
CUDA graph. The end-to-end oracle is `dataplane.layers.fused_moe.moe_reference` (the CPU path,
which cannot live here: this module imports triton); `align_reference` below is the torch
statement of step 1.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dataplane.kernels.sizes import cdiv, next_power_of_2


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes. BLOCK_M is shared by both GEMMs (it is the padding of the sorted rows); gate_up's
    block_n counts columns of each half, so its accumulators are [BLOCK_M, 2 * block_n] in all."""
    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    group_m: int = 1


# By num_tokens, for Qwen3-30B-A3B shapes on H100/H200 (hidden 2048, 128 experts, top-8,
# moe_intermediate 768 / tp): decode (few rows per expert) is weight-bandwidth bound, so small
# BLOCK_M and enough programs to keep HBM busy; prefill is compute bound, so 128-row tiles for
# wgmma, 8 warps and 4 stages (48 KiB of shared memory a stage). bench/fused_moe.py --tune checks.
_CONFIGS: list[tuple[int | None, MoeConfig]] = [
    (32, MoeConfig(16, GemmTiles(32, 128, 4, 4), GemmTiles(64, 128, 4, 4))),
    (128, MoeConfig(16, GemmTiles(64, 128, 4, 3), GemmTiles(128, 128, 4, 3))),
    (384, MoeConfig(32, GemmTiles(64, 128, 4, 3), GemmTiles(128, 128, 4, 3), group_m=8)),
    (1024, MoeConfig(64, GemmTiles(64, 64, 4, 4), GemmTiles(128, 64, 4, 4), group_m=8)),
    (None, MoeConfig(128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4), group_m=8)),
]


def config_for(num_tokens: int) -> MoeConfig:
    return next(config for limit, config in _CONFIGS if limit is None or num_tokens <= limit)


@triton.jit
def _tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile column), GROUP_M row tiles sweeping the columns together so
    that the weight tiles they share (same expert) are read from L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(
    topk_ids_ptr, sorted_ids_ptr, block_expert_ids_ptr, num_padded_ptr, cursor_ptr,
    num_pairs, num_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
):
    """One program. Counts come from a histogram (registers); pair p = token * top_k + k then
    lands at row cursor[expert], an atomic bump, so the order within an expert's run is arbitrary.
    The GEMMs treat rows independently, so results do not depend on it. Padding rows hold
    num_pairs."""
    experts = tl.arange(0, EXPERTS_POW2)
    is_expert = experts < NUM_EXPERTS
    counts = tl.zeros((EXPERTS_POW2,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=0).to(tl.int32)
        counts += tl.histogram(ids, EXPERTS_POW2, mask=pairs < num_pairs)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + experts, ends - padded, mask=is_expert)
    for start in range(0, num_blocks * BLOCK_M, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + rows, num_pairs, mask=rows < num_blocks * BLOCK_M)
    ends = tl.where(is_expert, ends, 2147483647)
    for start in range(0, num_blocks, BLOCKS_CHUNK):
        blocks = start + tl.arange(0, BLOCKS_CHUNK)
        # the expert of a tile = the number of experts whose run ends at or before its first row
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ids_ptr + blocks, owner, mask=blocks < num_blocks)
    tl.debug_barrier()  # cursors and padding written (by all threads) before the scatter
    for start in range(0, num_pairs, CHUNK):
        pairs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=0)
        rows = tl.atomic_add(cursor_ptr + ids, 1, mask=pairs < num_pairs)
        tl.store(sorted_ids_ptr + rows, pairs, mask=pairs < num_pairs)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, sorted_ids_ptr, block_expert_ids_ptr, num_padded_ptr,
    num_pairs, num_blocks, hidden, inter,
    stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """act[row, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, inter + n]) for the sorted rows."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_ids_ptr + rows)
    # padding rows read token 0 (in bounds, so no mask); _down_kernel never stores their results
    token_ids = tl.where(pair_ids < num_pairs, pair_ids // TOP_K, 0).to(tl.int64)
    # columns wrap around instead of being masked: loads stay in bounds, the store drops extras
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token_ids[:, None] * stride_x + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    gate_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + inter * stride_wn  # [BLOCK_K, BLOCK_N] each
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            gate = tl.load(gate_ptrs)
            up = tl.load(up_ptrs)
        else:
            k_left = hidden - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            gate = tl.load(gate_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            up = tl.load(up_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # [BLOCK_M, BLOCK_N] float32
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    act_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=cols[None, :] < inter)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_kernel(
    act_ptr, w2_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ids_ptr,
    num_padded_ptr, num_pairs, num_blocks, hidden, inter,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[pair, n] = weight[pair] * (act[row] . w2[e, n]), stored at the pair's own row."""
    pid_m, pid_n = _tile(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_ids_ptr + rows)
    is_pair = pair_ids < num_pairs
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_act + offs_k[None, :]
    w_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = inter - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(topk_weights_ptr + pair_ids, mask=is_pair, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + pair_ids[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=is_pair[:, None] & (cols[None, :] < hidden))


def max_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles the sorted order can need: each expert that gets a pair pads at most block_m - 1."""
    return cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids: [num_tokens, top_k] int32/int64. Returns sorted_ids [num_blocks * block_m] int32
    (pair ids grouped by expert, padded with num_pairs), block_expert_ids [num_blocks] int32 and
    num_padded [1] int32 (rows in use; tiles past it are unused)."""
    assert topk_ids.dim() == 2 and topk_ids.is_contiguous()
    assert topk_ids.dtype in (torch.int32, torch.int64), topk_ids.dtype
    num_pairs = topk_ids.numel()
    num_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    experts_pow2 = next_power_of_2(num_experts)
    _align_kernel[(1,)](
        topk_ids, sorted_ids, block_expert_ids, num_padded, cursor, num_pairs, num_blocks,
        NUM_EXPERTS=num_experts, EXPERTS_POW2=experts_pow2, BLOCK_M=block_m, CHUNK=1024,
        BLOCKS_CHUNK=max(1, 8192 // experts_pow2), num_warps=8,
    )
    return sorted_ids, block_expert_ids, num_padded


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`align` in plain torch, in a canonical order (each expert's pairs ascending, its run padded
    with num_pairs to a multiple of block_m). Returns sorted_ids [num_padded], block_expert_ids
    [num_padded / block_m] and num_padded, on the CPU."""
    flat = topk_ids.flatten().cpu()
    runs, block_expert_ids = [], []
    for expert in range(num_experts):
        pairs = (flat == expert).nonzero().flatten()  # [n]
        num_tiles = cdiv(len(pairs), block_m)
        runs += [pairs, torch.full((num_tiles * block_m - len(pairs),), flat.numel())]
        block_expert_ids += [expert] * num_tiles
    return torch.cat(runs), torch.tensor(block_expert_ids), len(block_expert_ids) * block_m


def _fit(tiles: GemmTiles, n: int, k: int) -> tuple[int, int]:
    """Tiles no larger than the problem (tl.dot needs every side >= 16)."""
    return (min(tiles.block_n, max(16, next_power_of_2(n))),
            min(tiles.block_k, max(16, next_power_of_2(k))))


def _launch_gemms(x, w13, w2, topk_weights, sorted_ids, block_expert_ids, num_padded, top_k,
                  config: MoeConfig) -> torch.Tensor:
    hidden, inter = x.shape[1], w2.shape[2]
    num_pairs, num_blocks = topk_weights.numel(), block_expert_ids.numel()
    precision = "ieee" if x.dtype == torch.float32 else None  # no tf32 for float32 inputs
    act = torch.empty(num_blocks * config.block_m, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = _fit(config.gate_up, inter, hidden)
    _gate_up_kernel[(num_blocks * cdiv(inter, block_n),)](
        x, w13, act, sorted_ids, block_expert_ids, num_padded,
        num_pairs, num_blocks, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=config.group_m, EVEN_K=hidden % block_k == 0, DOT_PRECISION=precision,
        num_warps=config.gate_up.num_warps, num_stages=config.gate_up.num_stages,
    )
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k = _fit(config.down, hidden, inter)
    _down_kernel[(num_blocks * cdiv(hidden, block_n),)](
        act, w2, out, topk_weights, sorted_ids, block_expert_ids, num_padded,
        num_pairs, num_blocks, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=config.group_m, EVEN_K=inter % block_k == 0, DOT_PRECISION=precision,
        num_warps=config.down.num_warps, num_stages=config.down.num_stages,
    )
    return out  # [num_pairs, hidden]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), an expert being
    w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)).

    x: [num_tokens, hidden]; w13: [num_experts, 2 * I, hidden] (gate rows, then up rows);
    w2: [num_experts, hidden, I]; topk_weights: [num_tokens, top_k] float32; topk_ids:
    [num_tokens, top_k] int32 or int64. Returns [num_tokens, hidden] in x's dtype.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert w13.dtype == w2.dtype == x.dtype, (x.dtype, w13.dtype, w2.dtype)
    assert w13.shape == (num_experts, two_inter, hidden) and two_inter % 2 == 0, w13.shape
    assert w2.shape == (num_experts, hidden, two_inter // 2), (w2.shape, w13.shape)
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k)
    assert topk_weights.dtype == torch.float32, topk_weights.dtype
    for t in (x, w13, w2, topk_weights, topk_ids):
        assert t.is_contiguous() and t.device == x.device, "contiguous, on one device"
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    config = config or config_for(num_tokens)
    sorted_ids, block_expert_ids, num_padded = align(topk_ids, num_experts, config.block_m)
    out = _launch_gemms(x, w13, w2, topk_weights, sorted_ids, block_expert_ids, num_padded, top_k,
                        config)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)  # [num_tokens, hidden]
