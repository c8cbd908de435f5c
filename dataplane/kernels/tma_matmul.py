"""y = x @ w.T for decode steps of 177-256 rows, for the column-parallel layers (qkv_proj,
gate_up_proj), optionally with SiLU-and-mul in the epilogue (decode_matmul.py's gated form);
and gate_up_proj + SiLU in prompt steps of 2,048 rows and more.
Hopper and later: both operands arrive through the Tensor Memory Accelerator (TMA), the
hardware's bulk copies into shared memory, and the output leaves through it.

Why: at these sizes cuBLAS runs Qwen3-0.6B's qkv_proj in ~5.8 us and gate_up_proj +
silu_and_mul in ~9.7 (bench/results/h200/tma_gemm-8efbae0.json) for ~2.2 and ~3.3 us of
tensor-core work, and decode_matmul.py's pointer loads lost to it there in every tile tried.
With TMA the loads need no address arithmetic or masks (rows past the batch read as zeros, and
their outputs are never stored), and the gated epilogue saves silu_and_mul's launch and its
round trip through memory. Each program owns a BLOCK_M x BLOCK_N output tile; the row tiles of a
strip are neighbours in the grid, so they run together and share its weights in the L2.

The reference, tma_matmul_ref, is what the layers run otherwise (cuBLAS, then SiLU-and-mul if
gated: decode_matmul_ref), whose rounding the epilogue follows.
"""

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors: Triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

from dataplane.kernels.decode_matmul import (MAX_K, decode_matmul_ref, gemm_output,
                                             silu_and_mul_rounded)
from dataplane.kernels.pdl import launch_options, prefetch_args, prefetch_rows, wait_for_inputs
from dataplane.kernels.sizes import cdiv


@triton.jit
def _tma_matmul_kernel(
    x_desc, w_desc, out_desc, w_ptr,
    K: tl.constexpr, UP_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr,
    ELEMS_PER_LINE: tl.constexpr, NUM_LINES_POW2: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m, pid_n = _tile(GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    gated = UP_OFFSET > 0  # UP_OFFSET: the up rows' first row in w (gate's are the first)
    if USE_PDL and tl.program_id(0) == 0:  # the weights are no kernel's output
        cols = off_n + tl.arange(0, BLOCK_N)
        prefetch_rows(w_ptr, cols, K, 0, K, ELEMS_PER_LINE, NUM_LINES_POW2)
        if gated:
            prefetch_rows(w_ptr, cols + UP_OFFSET, K, 0, K, ELEMS_PER_LINE, NUM_LINES_POW2)
    wait_for_inputs(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K]
        acc = tl.dot(x, w_desc.load([off_n, k]).T, acc)  # w tile: [BLOCK_N, BLOCK_K]
        if gated:
            acc_up = tl.dot(x, w_desc.load([off_n + UP_OFFSET, k]).T, acc_up)
    dtype = out_desc.dtype
    if gated:
        acc = silu_and_mul_rounded(acc, acc_up, dtype)
    out_desc.store([off_m, off_n], acc.to(dtype))


@triton.jit
def _tile(GROUP_M: tl.constexpr):
    """This program's (row tile, column tile). GROUP_M 0: the grid's own order, the row tiles
    of a column strip neighbours (a decode batch's few row tiles share the strip's weights in
    the L2). Else column strips walked GROUP_M row tiles at a time, so that the programs running
    together read GROUP_M row tiles of x and not all of them (a prompt step's x is 32 MB at 16k
    rows, re-read from memory for every strip in the grid's order)."""
    if GROUP_M == 0:
        return tl.program_id(0), tl.program_id(1)
    num_m = tl.num_programs(0)
    pid = tl.program_id(1) * num_m + tl.program_id(0)
    per_group = GROUP_M * tl.num_programs(1)
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + pid % per_group % group_rows, pid % per_group // group_rows


# Bounds and tiles: bench/tma_gemm_probe.py on the H200 (us a Qwen3-0.6B layer as it runs, 28
# layers in a CUDA graph, 640-key contexts). With qkv_proj and gate_up_proj on this kernel the
# layer took 0.5-1.5 us less than with cuBLAS at 192 rows, 1.2-2.3 at 208-256
# (tma_layer-f037a6b.json), and 0.3-1.3 more at 160 (tma_gemm-8efbae0.json), where cuBLAS +
# silu_and_mul stay; on workload A the decode steps of 161-256 rows took 15-17 ms less a run
# (ab_tma-f037a6b.json). o_proj and down_proj on it were faster alone but slower in the layer
# (they stay on cuBLAS). Tiles: each GEMM's best alone at 192-256 rows; 64-row tiles (one
# warpgroup) beat 128 and 256.
MIN_ROWS = 177  # 176 runs in three 64-row tiles like 192, but cuBLAS is faster at fewer rows
MAX_ROWS = 256  # the largest measured
_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_stages=4, num_warps=4, GROUP_M=0)
_GATED_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=4, num_warps=4, GROUP_M=0)
# Prompt steps: gate_up_proj + SiLU from PREFILL_MIN_ROWS rows, where cuBLAS runs the GEMM near
# the dense peak and silu_and_mul then reads its [rows, 2 x width] product back. On an H100
# (tma_gemm_probe.py --prefill, bench/results/h100/tma_prefill-d10ea35.json; 28 layers in a
# graph) this kernel took 43.3 / 83.6 / 175.8 / 364.9 us a layer at 2k / 4k / 8k / 16k rows
# against cuBLAS + silu_and_mul's 49.2 / 99.1 / 211.6 / 421.7; on workload A (ab_prefill-d10ea35)
# the prompt steps took 36.1-36.2 ms against 37.2-37.6. 128 x 128 tiles in 3 stages were the
# best at 4k-16k rows and within 1 us of it at 2k. Grouped row tiles (GROUP_M 8) took 401 ->
# 365 us at 16k rows, tied at 8k and lost at 4k (89 against 84): grouped above 8,192 rows.
PREFILL_MIN_ROWS = 2048  # a step of 1,025-2,048 tokens runs in the 2,048-token graph pieces
PREFILL_GROUPED_ABOVE = 8192
_PREFILL_GATED_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=3, num_warps=8,
                             GROUP_M=0)
_PREFILL_GROUPED_CONFIG = _PREFILL_GATED_CONFIG | dict(GROUP_M=8)


def tma_matmul_config(gated: bool, num_rows: int = MAX_ROWS) -> dict:
    """The kernel settings for num_rows rows (shared: copy before changing)."""
    if gated and num_rows > PREFILL_GROUPED_ABOVE:
        return _PREFILL_GROUPED_CONFIG
    if gated and num_rows >= PREFILL_MIN_ROWS:
        return _PREFILL_GATED_CONFIG
    return _GATED_CONFIG if gated else _CONFIG


def tma_matmul_pays(x: torch.Tensor, n: int, k: int, gated: bool = False) -> bool:
    """Whether tma_matmul beats cuBLAS (and a separate SiLU-and-mul) for x [num_rows, k] @ a
    weight of n output columns (gated: the width of gate alone), and TMA can read x: a CUDA
    device of compute capability 9 or later, 16-bit floats, 16-byte aligned rows, and a Triton
    with host-side TMA descriptors. MIN_ROWS-MAX_ROWS rows (a decode step's), or gated from
    PREFILL_MIN_ROWS (a prompt step's)."""
    num_rows = x.shape[0]
    cfg = tma_matmul_config(gated, num_rows)
    in_range = MIN_ROWS <= num_rows <= MAX_ROWS or gated and num_rows >= PREFILL_MIN_ROWS
    return (TensorDescriptor is not None and in_range and k <= MAX_K
            and x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda
            and torch.cuda.get_device_capability(x.device)[0] >= 9
            and x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0
            and n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0)


def tma_matmul(x: torch.Tensor, w: torch.Tensor, gated: bool = False,
               config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, K] (rows may be strided), w: [N, K] contiguous, both bf16 or fp16. Returns
    x @ w.T [num_rows, N], or with gated silu(x @ w[:N/2].T) * (x @ w[N/2:].T) [num_rows, N/2].
    config: over tma_matmul_config's choice (BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
    num_warps, GROUP_M)."""
    assert x.dtype in (torch.bfloat16, torch.float16), x.dtype
    num_rows, k = x.shape
    cfg = tma_matmul_config(gated, num_rows) | (config or {})
    out = gemm_output(x, w, gated, cfg, out)
    n, width = w.shape[0], out.shape[1]
    if num_rows == 0:
        return out
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_desc = TensorDescriptor(x, [num_rows, k], [x.stride(0), 1], [bm, bk])
    w_desc = TensorDescriptor(w, [n, k], [k, 1], [bn, bk])
    out_desc = TensorDescriptor(out, [num_rows, width], [out.stride(0), 1], [bm, bn])
    grid = (cdiv(num_rows, bm), width // bn)
    _tma_matmul_kernel[grid](
        x_desc, w_desc, out_desc, w, K=k, UP_OFFSET=width if gated else 0, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=cfg["num_stages"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"],
        **prefetch_args(w, k), **launch_options(x.device, num_rows))
    return out


def tma_matmul_ref(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """What the layers run otherwise: decode_matmul.py's reference (the GEMM, then SiLU-and-mul
    if gated)."""
    return decode_matmul_ref(x, w, gated)
