"""y = x @ w.T for the few rows of a decode step, for the column-parallel layers (qkv_proj,
gate_up_proj), optionally with SiLU-and-mul in the epilogue: out = silu(x @ gate.T) * (x @ up.T)
over the merged [gate | up] weights, so the MLP's activation is not a launch of its own.

Why: at decode batch sizes cuBLAS spends 5-6 us on Qwen3-0.6B's qkv_proj (8 MB of weights, 2 us
at the copy bandwidth) and gate_up_proj (12.6 MB, 3 us) (bench/results/h200/gemm.json), and
every kernel between two of ours is one that programmatic dependent launch cannot overlap
(dataplane/kernels/pdl.py). Here each program owns a BLOCK_N strip of output columns for a
BLOCK_M tile of rows and streams the strip's weights once; with PDL it asks the L2 for the
strip before it waits for x, so the weights' latency passes while the kernel before it runs.

As in splitk_matmul.py the weight tile is the dot's left operand ([BLOCK_N, BLOCK_K] @
[BLOCK_K, BLOCK_M]): output columns fill the tensor core's wide side, the few rows its narrow
one. Rounding follows what it replaces: cuBLAS rounds its float32 sums to the dtype; the gated
epilogue then computes silu_and_mul.py's float32 silu of the rounded gate, rounds it, multiplies
by the rounded up and rounds again.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.pdl import launch_options, prefetch_args, prefetch_rows, wait_for_inputs
from dataplane.kernels.sizes import cdiv


@triton.jit
def silu_and_mul_rounded(gate_acc, up_acc, dtype: tl.constexpr):
    """The gated epilogue from float32 sums, rounded as cuBLAS + silu_and_mul.py round (see
    the module docstring); shared with tma_matmul.py."""
    gate = gate_acc.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return silu * up_acc.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _decode_matmul_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, stride_x_row, stride_out_row,
    K: tl.constexpr, UP_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, ELEMS_PER_LINE: tl.constexpr,
    NUM_LINES_POW2: tl.constexpr, USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gated = UP_OFFSET > 0  # UP_OFFSET: the up rows' first row in w (gate's are the first)
    # the weights are no kernel's output: fetch them while the one before runs (once a strip)
    if USE_PDL and tl.program_id(1) == 0:
        prefetch_rows(w_ptr, cols, K, 0, K, ELEMS_PER_LINE, NUM_LINES_POW2)
        if gated:
            prefetch_rows(w_ptr, cols + UP_OFFSET, K, 0, K, ELEMS_PER_LINE, NUM_LINES_POW2)
    wait_for_inputs(USE_PDL)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows[None, :].to(tl.int64) * stride_x_row + ks[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=row_mask[None, :], other=0.0)
        acc = tl.dot(tl.load(w_ptrs + k), x, acc, input_precision=DOT_PRECISION)
        if gated:
            acc_up = tl.dot(tl.load(w_ptrs + UP_OFFSET * K + k), x, acc_up,
                            input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    if gated:
        acc = silu_and_mul_rounded(acc, acc_up, dtype)
    dst = out_ptr + rows[None, :].to(tl.int64) * stride_out_row + cols[:, None]
    tl.store(dst, acc.to(dtype), mask=row_mask[None, :])


# Bounds and tiles: bench/decode_layer_probe.py on the H200 (decode_layer-865485f.json, us a
# Qwen3-0.6B layer in CUDA graphs, cuBLAS + PDL against ours + PDL): 27.9 / 27.8 at 1 row,
# 29.2 / 28.8 at 8, 37.1 / 34.8 at 32; from 64 rows ours loses (44.2 / 46.6 at 64, 55.0 / 58.4
# at 128): alone, its gate_up + SiLU took 9.0 us at 64 rows against cuBLAS + silu_and_mul's 7.0.
# The wider sweep (`--sweep`, decode_layer_sweep-2a21cfb.json) found plain tiles that tie cuBLAS
# alone at 64 and 128 rows (4.99 / 4.99 us, 5.27 / 5.27), so qkv_proj stays ours up to
# pdl.MAX_ROWS, where PDL overlaps it with the norm before and the q/k norm after (workload A,
# 3761e36: decode steps of 64-128 rows 0.5-1.1% faster; 33-63 rows not measured apart); the
# gated kernel still loses there (8.4 against 7.2 us) and stops at 32.
MAX_ROWS = 32  # gated
MAX_ROWS_PLAIN = 128  # pdl.MAX_ROWS's bound, measured on its own: beyond it ours loses alone
# gate_up_proj on the plain kernel and silu_and_mul after it, above MAX_ROWS: on the H200
# (decode_layer_probe.py --gate-up, gate_up-8acdd6b.json, us a layer as it runs against cuBLAS +
# silu_and_mul) 83.1 against 85.2 at 48 rows, 99.9 against 100.2 at 64, but 125.0 against 121.1
# at 96 and 138.1 against 133.4 at 128; workload A's decode steps of 33-64 rows 0.9% faster,
# 65-128 rows 1.9-2.1% slower (qwen3-0.6b-inprocess-tp1-8acdd6b-gate-up-{plain128,cublas}-*.json).
MAX_ROWS_PLAIN_MLP = 64
SMALL_TILE_ROWS = 32  # _CONFIG up to here, _WIDE_CONFIG above
MAX_K = 1024  # Qwen3-0.6B's hidden size; wider inputs keep cuBLAS (not measured)
# 1-32 rows, plain and gated: 64-deep K tiles in 8 stages, so that half of a strip's loads are
# in flight at once. The probe's layer as it runs (decode_layer_probe.py --stages,
# decode_layer_stages-d68aadb.json, with split-K at 4 stages) took 42.3 against 43.6 us at 8
# rows and 64.5 against 65.6 at 32 with the earlier 128-deep tiles in 3 stages (the probe's best
# with 3 stages, BLOCK_M 16 at 1-8 rows; one variant here); 6-8 stages of 128 do not fit the
# gated kernel's shared memory. On workload A the 1-32-row steps' run-to-run spread (1.86-2.14
# ms, ab_stages-779e7e5.json) hides the ~35 us a step this is worth.
_CONFIG = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32", num_warps=4,
               num_stages=8)
# the sweep's best at 64 and 128 rows (decode_layer_sweep-2a21cfb.json); 64-deep K in 8 stages
# lost 1.3 us a layer at 64 rows, 5 stages of 128 tied (decode_layer_stages-*.json)
_WIDE_CONFIG = _CONFIG | dict(BLOCK_M=64, BLOCK_K=128, num_stages=4)
# float32 (tests): exact dots, tiles small enough for the tiny checkpoints
_FLOAT32_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, DOT_PRECISION="ieee", num_warps=4,
                       num_stages=2)


def decode_matmul_config(dtype: torch.dtype, num_rows: int = 1) -> dict:
    """The kernel settings for this dtype and row count (shared: copy before changing)."""
    if dtype == torch.float32:
        return _FLOAT32_CONFIG
    return _CONFIG if num_rows <= SMALL_TILE_ROWS else _WIDE_CONFIG


def decode_matmul_pays(num_rows: int, n: int, k: int, dtype: torch.dtype,
                       gated: bool = False, before_silu: bool = False) -> bool:
    """Whether decode_matmul beats cuBLAS (and a separate SiLU-and-mul) for this GEMM and its
    tiles divide the shape. n: the output's width (gated: the width of gate alone). before_silu:
    plain, for gate_up_proj with a separate SiLU-and-mul after it. Float32 takes it on the same
    bounds, untimed, so the float32 GPU tests against transformers run it."""
    cfg = decode_matmul_config(dtype, num_rows)
    max_rows = MAX_ROWS if gated else MAX_ROWS_PLAIN_MLP if before_silu else MAX_ROWS_PLAIN
    return (0 < num_rows <= max_rows and k <= MAX_K
            and n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0)


def gemm_output(x: torch.Tensor, w: torch.Tensor, gated: bool, cfg: dict,
                out: torch.Tensor | None) -> torch.Tensor:
    """Checks a column GEMM's operands against its tiles cfg (x: [num_rows, K], rows may be
    strided; w: [N, K] contiguous, of x's dtype) and returns its output [num_rows, N], or
    [num_rows, N / 2] gated: `out` checked, or a new tensor. Shared with tma_matmul.py."""
    num_rows, k = x.shape
    n = w.shape[0]
    assert w.shape == (n, k) and w.is_contiguous() and x.stride(1) == 1 and x.dtype == w.dtype
    assert not gated or n % 2 == 0
    width = n // 2 if gated else n
    assert k % cfg["BLOCK_K"] == 0 and width % cfg["BLOCK_N"] == 0, (k, width, cfg)
    if out is None:
        out = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, width) and out.dtype == x.dtype and out.stride(1) == 1
    return out


def decode_matmul(x: torch.Tensor, w: torch.Tensor, gated: bool = False,
                  config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, K] (rows may be strided), w: [N, K] contiguous, the same dtype. Returns
    x @ w.T [num_rows, N], or with gated silu(x @ w[:N/2].T) * (x @ w[N/2:].T) [num_rows, N/2].
    config: over decode_matmul_config's choice (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages)."""
    num_rows, k = x.shape
    cfg = decode_matmul_config(x.dtype, num_rows) | (config or {})
    out = gemm_output(x, w, gated, cfg, out)
    width = out.shape[1]
    if num_rows == 0:
        return out
    grid = (width // cfg["BLOCK_N"], cdiv(num_rows, cfg["BLOCK_M"]))
    _decode_matmul_kernel[grid](
        x, w, out, num_rows, x.stride(0), out.stride(0), K=k, UP_OFFSET=width if gated else 0,
        **prefetch_args(w, k), **cfg, **launch_options(x.device, num_rows))
    return out


def decode_matmul_ref(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """What the layers run otherwise: the GEMM (cuBLAS on CUDA), then SiLU-and-mul if gated."""
    y = torch.nn.functional.linear(x, w)
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(y.dtype).float() * up.float()).to(y.dtype)
