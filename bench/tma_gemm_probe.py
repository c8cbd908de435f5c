"""Can a GEMM of ours that loads its tiles through the Tensor Memory Accelerator (TMA) beat
cuBLAS for qkv_proj and gate_up_proj at workload A's large decode batches (129-256 rows)?

Why: at 256 rows cuBLAS runs qkv_proj in 6.2 us and gate_up_proj + silu_and_mul in 9.6
(decode_layer_sweep-2a21cfb.json) for ~2.2 and ~3.3 us of tensor-core work and 2-3 us of
weights; the decode steps of 129-256 rows spend ~1.2 ms a step over their bytes, the GEMMs most
of it. decode_matmul.py (pointer loads, cp.async) lost there in every tile of the fourteenth
session's sweep (7.65 and 11.1 us at 256 rows). This kernel loads both operands through TMA
descriptors (the hardware's bulk copies, out-of-bounds rows zero-filled: no masks), stores
through one, and can take the gated SiLU-and-mul epilogue, so gate_up_proj needs no second
launch. The kernel lives here until it wins; then it moves to dataplane/kernels/.

1. Each GEMM alone, 28 launches with distinct weights in a CUDA graph, at ROWS: cuBLAS
   (+ silu_and_mul) against every config of CONFIGS, the three fastest again with PDL, each
   checked against cuBLAS's result.
2. The layer as it runs (decode_layer_probe's Layers, 640-key contexts) against the same layer
   with qkv_proj and gate_up_proj on this kernel at each GEMM's best config from 1.; with PDL at
   every launch as a third arm. Two rounds, interleaved.

`python3 bench/tma_gemm_probe.py $OUT/tma_gemm.json` (PYTHONPATH: the repo and bench/);
`--check` runs only a correctness check of every config on small shapes (CPU with
TRITON_INTERPRET=1 too).
"""

import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dataplane.kernels import pdl
from dataplane.kernels.pdl import prefetch_args, prefetch_rows, wait_for_inputs


@triton.jit
def _tma_matmul_kernel(
    x_desc, w_desc, out_desc, w_ptr,
    K: tl.constexpr, UP_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SWAP: tl.constexpr, NUM_STAGES: tl.constexpr,
    ELEMS_PER_LINE: tl.constexpr, NUM_LINES_POW2: tl.constexpr, USE_PDL: tl.constexpr,
):
    # row tiles vary fastest: a strip's row tiles run together and share its weights in the L2
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * BLOCK_N
    gated = UP_OFFSET > 0
    if USE_PDL and tl.program_id(0) == 0:
        cols = off_n + tl.arange(0, BLOCK_N)
        prefetch_rows(w_ptr, cols, K, 0, K, ELEMS_PER_LINE, NUM_LINES_POW2)
        if gated:
            prefetch_rows(w_ptr, cols + UP_OFFSET, K, 0, K, ELEMS_PER_LINE, NUM_LINES_POW2)
    wait_for_inputs(USE_PDL)
    if SWAP:  # weights on the tensor core's wide side: [BLOCK_N, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K]
        w = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]
        if SWAP:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
        if gated:
            up = w_desc.load([off_n + UP_OFFSET, k])
            if SWAP:
                acc_up = tl.dot(up, x.T, acc_up)
            else:
                acc_up = tl.dot(x, up.T, acc_up)
    dtype = out_desc.dtype
    if gated:  # decode_matmul.py's rounding: what cuBLAS + silu_and_mul compute
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    if SWAP:
        acc = acc.T
    out_desc.store([off_m, off_n], acc.to(dtype))


def tma_matmul(x: torch.Tensor, w: torch.Tensor, gated: bool, cfg: dict,
               use_pdl: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_rows, K] (rows may be strided, 16-byte aligned), w: [N, K] contiguous. Returns
    x @ w.T [num_rows, N], or gated silu(x @ w[:N/2].T) * (x @ w[N/2:].T) [num_rows, N/2].
    cfg: BLOCK_M, BLOCK_N, BLOCK_K, SWAP, num_stages, num_warps."""
    num_rows, k = x.shape
    n = w.shape[0]
    width = n // 2 if gated else n
    assert w.shape == (n, k) and w.is_contiguous() and x.stride(1) == 1 and x.dtype == w.dtype
    assert k % cfg["BLOCK_K"] == 0 and width % cfg["BLOCK_N"] == 0, (k, width, cfg)
    if out is None:
        out = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x_desc = TensorDescriptor(x, [num_rows, k], [x.stride(0), 1], [bm, bk])
    w_desc = TensorDescriptor(w, [n, k], [k, 1], [bn, bk])
    out_desc = TensorDescriptor(out, [num_rows, width], [out.stride(0), 1], [bm, bn])
    grid = (triton.cdiv(num_rows, bm), width // bn)
    options = {"USE_PDL": True, "launch_pdl": True} if use_pdl else {"USE_PDL": False}
    _tma_matmul_kernel[grid](
        x_desc, w_desc, out_desc, w, K=k, UP_OFFSET=width if gated else 0, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, SWAP=cfg["SWAP"], NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"], **prefetch_args(w, k), **options)
    return out


def reference(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    y = F.linear(x, w)
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    return (F.silu(gate.float()).to(y.dtype).float() * up.float()).to(y.dtype)


def smem_bytes(cfg: dict, gated: bool) -> int:
    per_stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"] * (2 if gated else 1)) * cfg["BLOCK_K"] * 2
    return per_stage * cfg["num_stages"] + cfg["BLOCK_M"] * cfg["BLOCK_N"] * 2


SMEM_LIMIT = 220 * 1024
ROWS = [256, 224, 192, 160]
CONTEXT = 640
# 4 warps (one warpgroup) up to 128-row tiles, 8 for 128 and 256; SWAP puts the weights on the
# tensor core's wide side, as decode_matmul does for a few rows
CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, SWAP=swap, num_stages=s, num_warps=w)
           for m, n, k, s, w, swap in itertools.product(
               (64, 128, 256), (32, 64, 128), (64, 128), (3, 4), (4, 8), (False, True))
           if (w == 4) == (m < 256) or (m == 128 and not swap)
           if not swap or (m < 256 and n >= 64)]
SHAPES = {"qkv": (4096, 1024, False), "gate_up": (6144, 1024, True),
          "o": (1024, 2048, False), "down": (1024, 3072, False)}  # (N, K, gated)


def check(on_cpu: bool) -> None:
    """Every config against the reference on small shapes (float32 sums of bf16 inputs; on the
    CPU, float16: the interpreter reads bf16 descriptors wrong)."""
    device, dtype = ("cpu", torch.float16) if on_cpu else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    configs = CONFIGS[::7] if on_cpu else CONFIGS
    for (n, k, gated), rows in itertools.product(((256, 128, False), (512, 256, True)), (7, 130)):
        x = torch.randn(rows, k, device=device).to(dtype)
        w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
        expected = reference(x, w, gated).float()
        for cfg in configs:
            if (n // 2 if gated else n) % cfg["BLOCK_N"] or k % cfg["BLOCK_K"]:
                continue
            got = tma_matmul(x, w, gated, cfg).float()
            diff = (got - expected).abs().max().item()
            assert diff < 0.05, (cfg, rows, gated, diff)
    print(f"check: {len(configs)} configs within 0.05 of the reference", flush=True)


def alone(rows: int, name: str, weights: list[torch.Tensor], x: torch.Tensor) -> dict:
    """One GEMM 28 times in a graph: cuBLAS, then each config that fits the shared memory, then
    the three fastest with PDL; each config's largest difference from cuBLAS's result."""
    from kernels import graph_us
    from dataplane.kernels.silu_and_mul import silu_and_mul
    gated = SHAPES[name][2]
    expected = reference(x, weights[0], gated).float()

    def cublas():
        for w in weights:
            y = F.linear(x, w)
            if gated:
                silu_and_mul(y)

    def timed(cfg: dict, use_pdl: bool) -> dict:
        entry = dict(cfg, pdl=use_pdl)
        try:
            diff = (tma_matmul(x, weights[0], gated, cfg).float() - expected).abs().max().item()
            us = graph_us(lambda: [tma_matmul(x, w, gated, cfg, use_pdl) for w in weights])
            return entry | dict(us=us / len(weights), max_abs_diff=diff)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            return entry | dict(error=f"{type(e).__name__}: {e}"[:200])

    result = dict(cublas_us=graph_us(cublas) / len(weights), configs=[])
    fitting = [cfg for cfg in CONFIGS if smem_bytes(cfg, gated) <= SMEM_LIMIT]
    result["configs"] = [timed(cfg, False) for cfg in fitting]
    fastest = sorted((c for c in result["configs"] if "us" in c), key=lambda c: c["us"])[:3]
    result["configs"] += [timed({k: c[k] for k in CONFIGS[0]}, True) for c in fastest]
    ok = sorted((c for c in result["configs"] if "us" in c), key=lambda c: c["us"])
    result["best"] = ok[0]
    top = "; ".join(f"{c['us']:.2f} m{c['BLOCK_M']} n{c['BLOCK_N']} k{c['BLOCK_K']} "
                    f"s{c['num_stages']} w{c['num_warps']}{' swap' if c['SWAP'] else ''}"
                    f"{' pdl' if c['pdl'] else ''} (diff {c['max_abs_diff']:.1e})"
                    for c in ok[:3])
    print(f"{rows:3d} rows {name:7s}: cuBLAS {result['cublas_us']:.2f} us; TMA {top}", flush=True)
    return result


def layer(rows: int, best: dict[str, dict]) -> dict[str, list]:
    """The layer as it runs against qkv/gate_up on the TMA kernel ("tma"), also o/down
    ("tma4"), each also with PDL at every launch ("_pdl"); two rounds, interleaved."""
    from decode_layer_probe import LAYERS, Layers
    from kernels import graph_us
    layers = Layers(rows, CONTEXT)
    default_max_rows = pdl.MAX_ROWS

    def on_tma(x, w, name, gated=False):
        return tma_matmul(x, w, gated, best[name],
                          use_pdl=pdl.launch_options(x.device, rows)["USE_PDL"])

    def column(x, w, gated):
        return on_tma(x, w, "gate_up" if gated else "qkv", gated)

    def row(x, w):
        return on_tma(x, w, "o" if w.shape[1] == SHAPES["o"][1] else "down")

    result = {arm: [] for arm in ("shipped", "tma", "tma_pdl", "tma4", "tma4_pdl")}
    for _ in range(2):
        for arm in result:
            layers.column_gemm = None if arm == "shipped" else column
            layers.row_gemm = row if arm.startswith("tma4") else None
            pdl.MAX_ROWS = 1 << 30 if arm.endswith("_pdl") else default_max_rows
            try:
                result[arm].append(graph_us(lambda: layers.step("routed")) / LAYERS)
            finally:
                pdl.MAX_ROWS = default_max_rows
    print(f"{rows:3d} rows of {CONTEXT} keys, layer us: " + "; ".join(
        f"{arm} " + " ".join(f"{us:.2f}" for us in runs) for arm, runs in result.items()),
        flush=True)
    return result


def main() -> None:
    if "--check" in sys.argv:
        check(on_cpu=not torch.cuda.is_available())
        return
    import run_info
    from decode_layer_probe import LAYERS, randn
    torch.manual_seed(0)
    pdl.set_enabled(True)
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(), shapes=[])
    for rows in ROWS:
        entry = dict(rows=rows, alone={})
        for name, (n, k, _) in SHAPES.items():
            weights = [randn(n, k, scale=k ** -0.5) for _ in range(LAYERS)]
            entry["alone"][name] = alone(rows, name, weights, randn(rows, k))
        best = {name: {k: v for k, v in r["best"].items()
                       if k not in ("us", "max_abs_diff", "pdl")}
                for name, r in entry["alone"].items()}
        entry["layer_us"] = layer(rows, best)
        report["shapes"].append(entry)
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
