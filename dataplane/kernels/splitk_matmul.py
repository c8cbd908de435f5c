"""x @ w.T cut along K into float32 partial sums, for the decode step's row-parallel layers
(o_proj, down_proj: N = hidden size, small next to K), whose consumer, the residual add and
RMSNorm, sums the partials as it loads them (rmsnorm.py, PARTS).

Why: at decode batch sizes cuBLAS runs these two GEMMs at ~20-25% of the copy bandwidth
(bench/results/h200/gemm.json: o_proj's 4 MB in 5.1-6.3 us): N = 1024 gives it few output
tiles, and a split-K reduction inside a GEMM costs a second pass or a cross-program handshake.
Here every program reads one [BLOCK_N, K / SPLITS] strip of weights once and writes its
[rows, BLOCK_N] partial; nothing waits on another program.

The weight tile is the dot's left operand ([BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]): N fills the
tensor core's 64-row side, the few batch rows its narrow side.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.pdl import launch_options, prefetch_args, prefetch_rows, wait_for_inputs
from dataplane.kernels.sizes import cdiv


@triton.jit(do_not_specialize=["num_rows"])
def _splitk_kernel(
    x_ptr, w_ptr, part_ptr, num_rows, stride_x_row, stride_w_row,
    N: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, ELEMS_PER_LINE: tl.constexpr,
    NUM_LINES_POW2: tl.constexpr, USE_PDL: tl.constexpr,
):
    col_tile = tl.program_id(0)
    split = tl.program_id(1)
    # the weights are no kernel's output: fetch them while the one before runs (once a strip)
    if USE_PDL and tl.program_id(2) == 0:
        prefetch_rows(w_ptr, col_tile * BLOCK_N + tl.arange(0, BLOCK_N), stride_w_row,
                      split * K_SPLIT, K_SPLIT, ELEMS_PER_LINE, NUM_LINES_POW2)
    wait_for_inputs(USE_PDL)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    ks = split * K_SPLIT + tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in range(0, K_SPLIT, BLOCK_K):
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w_row + (ks + k)[None, :])
        x = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_x_row + (ks + k)[:, None],
                    mask=row_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
        acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
    dst = part_ptr + (split * num_rows + rows[None, :]).to(tl.int64) * N + cols[:, None]
    tl.store(dst, acc, mask=row_mask[None, :])


# Measured on the H200 (bench/splitk_probe.py, splitk-3a1103c.json: GEMM + the norm that sums
# the partials, against cuBLAS + the norm, in CUDA graphs): Qwen3-0.6B's o_proj 5.9-6.8 against
# 7.6-7.9 us at 1-128 rows (11.4 at 1), down_proj 6.9-7.8 against 7.9-8.8; at 256 rows no gain.
# Wider outputs: Qwen3-30B-A3B's o_proj (N 2048) gained only 0.3-0.5 us, Qwen3-8B's o_proj and
# down_proj (N 4096) lose at 64-128 rows: every output wider than 1024 keeps cuBLAS.
MAX_ROWS = 128
MAX_N = 1024


def splitk_pays(num_rows: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether splitk_matmul beats cuBLAS for this GEMM (and its tiles divide the shape). Float32
    (tests and --dtype float32) takes it on the same bounds, untimed: that is what puts the split-K
    layers under the float32 GPU tests against transformers."""
    cfg = splitk_config(dtype)
    return (0 < num_rows <= MAX_ROWS and n <= MAX_N and n % cfg["BLOCK_N"] == 0
            and k % (cfg["SPLITS"] * cfg["BLOCK_K"]) == 0)


# Tiles and split count: the probe's best at every batch size up to MAX_ROWS, one BLOCK_M for
# every batch (one compiled variant a shape, met by configure's captures). 4 stages put all of
# o_proj's 512-deep split (4 tiles) in flight at once: the layer as it runs took 1.4-2.8 us less
# than with 3 at 8-128 rows (decode_layer_probe.py --stages, decode_layer_stages-dd6468b.json and
# -d68aadb.json: 130.7 against 133.5 us at 128 rows), and workload A's decode steps of 97-128
# rows 0.8-1.0% less (ab_stages-779e7e5.json); 5-6 stages, or 64-deep tiles in 6-8, gained at
# most 0.2 us more. Above MAX_ROWS 4 stages lose 2.6-4.7 us a layer against cuBLAS, 3 tie
# (decode_layer_long_stages-e33315d.json).
_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLITS=4, DOT_PRECISION="tf32", num_warps=4,
               num_stages=4)
# float32 (tests): exact dots, tiles small enough for the tiny checkpoints
_FLOAT32_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, SPLITS=4, DOT_PRECISION="ieee",
                       num_warps=4, num_stages=2)


def splitk_config(dtype: torch.dtype) -> dict:
    """The kernel settings for this dtype (shared: copy before changing)."""
    return _FLOAT32_CONFIG if dtype == torch.float32 else _CONFIG


def splitk_matmul(x: torch.Tensor, w: torch.Tensor, config: dict | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, K] (rows may be strided), w: [N, K] contiguous, the same dtype. Returns the
    float32 partials [SPLITS, num_rows, N] whose sum over the first axis is x @ w.T. config:
    over splitk_config's choice (BLOCK_M, BLOCK_N, BLOCK_K, SPLITS, num_warps, num_stages)."""
    num_rows, k = x.shape
    n = w.shape[0]
    assert w.shape == (n, k) and w.is_contiguous() and x.stride(1) == 1 and x.dtype == w.dtype
    cfg = splitk_config(x.dtype) | (config or {})
    splits = cfg.pop("SPLITS")
    assert k % (splits * cfg["BLOCK_K"]) == 0 and n % cfg["BLOCK_N"] == 0, (k, n, splits, cfg)
    if out is None:
        out = torch.empty(splits, num_rows, n, dtype=torch.float32, device=x.device)
    assert out.shape == (splits, num_rows, n) and out.dtype == torch.float32 and out.is_contiguous()
    if num_rows == 0:
        return out
    grid = (n // cfg["BLOCK_N"], splits, cdiv(num_rows, cfg["BLOCK_M"]))
    _splitk_kernel[grid](x, w, out, num_rows, x.stride(0), w.stride(0), N=n, K_SPLIT=k // splits,
                         **prefetch_args(w, k // splits), **cfg,
                         **launch_options(x.device, num_rows))
    return out


def splitk_matmul_ref(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """The same partials in float32 torch: [splits, num_rows, N]."""
    xs = x.float().unflatten(1, (splits, -1)).transpose(0, 1)  # [splits, rows, K / splits]
    ws = w.float().unflatten(1, (splits, -1)).transpose(0, 1)  # [splits, N, K / splits]
    return xs @ ws.transpose(1, 2)
