"""y = x @ weight.T for the few rows of a decode step: x [num_rows, K], weight [N, K] (nn.Linear's
layout), num_rows up to a few hundred.

At these sizes a linear layer reads its weights once and does little arithmetic, so its floor is
the weight bytes over the memory bandwidth. cuBLAS runs each such GEMM in 5-8 us on the H200
whatever the weight size (bench/gemm.py: 23-28 us a Qwen3-0.6B layer for 7.4 us of weights):
the time goes to launching, filling the load pipeline from DRAM and draining it, not to bytes.
This kernel gives every program a BLOCK_N-wide strip of output columns for all rows of a BLOCK_M
tile and streams that strip's weights through a software pipeline. Without more it hit the same
floor (gemm-skinny-e055c6c.json). What it adds is programmatic dependent launch
(dataplane.kernels.pdl): its programs start while the kernel before it is still running and,
before waiting for that kernel's output (x), ask the L2 for the first PREFETCH_LINES 128-byte
lines of their weight strip, which do not depend on it. The weights' DRAM latency then passes
during the previous kernel, and the pipeline fills from L2. Which config (if any) beats cuBLAS
for a shape is measured at start-up (dataplane/layers/gemm_plan.py), not assumed.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.pdl import launch_options, wait_for_inputs

# Candidate tile configs; the start-up tuning times them against cuBLAS per shape and row count.
CONFIGS = [
    dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4),
    dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
]
MAX_BLOCK_M = 128
SHARED_MEMORY_BUDGET = 160 << 10  # bytes of pipelined tiles a config may use
PREFETCH_BUDGET = 16 << 20  # weight bytes a launch asks the L2 for ahead (the H200's L2: 50 MB)
LINE = 128  # bytes of an L2 line


@triton.jit
def _prefetch_strip(w_ptr, cols, stride_w_row, num_lines, ELEMS_PER_LINE: tl.constexpr,
                    PREFETCH_LINES: tl.constexpr):
    """Ask the L2 for the first num_lines lines of each of the strip's weight rows (no registers
    held, nothing waited for)."""
    lines = tl.minimum(tl.arange(0, PREFETCH_LINES), num_lines - 1)  # a repeat is harmless
    ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w_row + (lines * ELEMS_PER_LINE)[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_matmul_kernel(x_ptr, w_ptr, y_ptr, num_rows, num_cols, depth, num_lines,
                          stride_x_row, stride_w_row, stride_y_row,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          ELEMS_PER_LINE: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                          USE_PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_PDL:  # the weights are not the previous kernel's output: fetch them while it runs
        _prefetch_strip(w_ptr, cols, stride_w_row, num_lines, ELEMS_PER_LINE, PREFETCH_LINES)
    wait_for_inputs(USE_PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_mask = (rows < num_rows)[:, None]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w_row + ks[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, depth, BLOCK_K):  # depth % BLOCK_K == 0 and num_cols % BLOCK_N == 0
        x = tl.load(x_ptrs, mask=row_mask, other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y_row + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask)


def block_m(num_rows: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(num_rows)))


def fits(config: dict, num_rows: int, out_features: int, in_features: int,
         itemsize: int) -> bool:
    """Whether the config tiles this shape exactly and its pipeline fits in shared memory."""
    tile_bytes = (block_m(num_rows) + config["BLOCK_N"]) * config["BLOCK_K"] * itemsize
    return (out_features % config["BLOCK_N"] == 0 and in_features % config["BLOCK_K"] == 0
            and tile_bytes * config["num_stages"] <= SHARED_MEMORY_BUDGET)


def prefetch_lines(out_features: int, in_features: int, itemsize: int) -> int:
    """Lines of each weight row to prefetch: the whole row when the weights fit the budget, else
    the share of each row that does (the start of the stream is what the latency hurts)."""
    row_lines = -(-in_features * itemsize // LINE)
    return max(1, min(row_lines, PREFETCH_BUDGET // (LINE * out_features)))


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, config: dict,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, K] (unit stride along K); weight: [N, K] contiguous; config: one of CONFIGS
    that fits() the shape. Returns out: [num_rows, N] in x's dtype (float32 accumulation)."""
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    assert weight.shape == (num_cols, depth) and weight.is_contiguous()
    assert x.stride(1) == 1 and x.dtype == weight.dtype
    assert fits(config, num_rows, num_cols, depth, x.element_size()), (config, x.shape,
                                                                       weight.shape)
    if out is None:
        out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, num_cols) and out.stride(1) == 1
    if num_rows == 0:
        return out
    bm = block_m(num_rows)
    lines = prefetch_lines(num_cols, depth, x.element_size())
    _skinny_matmul_kernel[(num_cols // config["BLOCK_N"], triton.cdiv(num_rows, bm))](
        x, weight, out, num_rows, num_cols, depth, lines, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=bm, ELEMS_PER_LINE=LINE // x.element_size(),
        PREFETCH_LINES=triton.next_power_of_2(lines), **config, **launch_options(x.device))
    return out


def skinny_matmul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the layers run otherwise (cuBLAS on CUDA)."""
    return torch.nn.functional.linear(x, weight)
