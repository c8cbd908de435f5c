"""Micro-benchmark of the fused MoE kernel on Qwen3-30B-A3B shapes (bf16): the kernel with its
config table against the torch reference (the CPU path, run on the GPU), per token count, with
the time split into align / GEMMs / top-k sum, the error against the reference, and ratios to
the H200's measured roofline (4.3 TB/s, 790 TFLOP/s dense bf16: shared/gpu/README.md).

    PYTHONPATH=. python3 bench/fused_moe.py --out bench/results/fused_moe.json [--tune]

--tune also sweeps a small grid of tile configs per token count (each GEMM on its own, for each
BLOCK_M) and reports the best, to update the table in dataplane/kernels/fused_moe.py. A config
that fails (compile error, out of shared memory) is recorded and skipped.
"""

import argparse
import json
import time

import torch
import triton
from triton.testing import do_bench

import run_info

from dataplane.kernels.fused_moe import (GemmTiles, MoeConfig, _launch_gemms, align, config_for,
                                         fused_moe)
from dataplane.layers.fused_moe import moe_reference, select_experts

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS = 790e12
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
TUNE_TOKENS = [1, 16, 64, 256, 1024, 4096]
TUNE_GATE_UP = [GemmTiles(32, 128, 4, 4), GemmTiles(64, 128, 4, 3), GemmTiles(64, 64, 4, 4),
                GemmTiles(128, 64, 4, 3), GemmTiles(128, 64, 8, 4), GemmTiles(64, 128, 8, 3)]
TUNE_DOWN = [GemmTiles(64, 128, 4, 4), GemmTiles(128, 128, 4, 3), GemmTiles(128, 64, 4, 4),
             GemmTiles(256, 64, 8, 4), GemmTiles(128, 64, 8, 4), GemmTiles(256, 128, 8, 3)]


def problem(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int):
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=g)
           / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=g)
          / inter ** 0.5).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def describe(config: MoeConfig) -> str:
    """BM16 gate_up(n32 k128 w4 s4) down(n64 k128 w4 s4) group1"""
    def tiles(t: GemmTiles) -> str:
        return f"n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}"
    return (f"BM{config.block_m} gate_up({tiles(config.gate_up)}) down({tiles(config.down)}) "
            f"group{config.group_m}")


def roofline_ms(x, w13, w2, ids) -> tuple[float, float, float]:
    """(roofline ms, GB moved, GFLOP) of the operation: the routed experts' weights read once,
    x read and the output written once (the kernels' own intermediates are their overhead)."""
    num_tokens, hidden = x.shape
    inter, top_k = w2.shape[2], ids.shape[1]
    expert_bytes = 3 * hidden * inter * w13.element_size()
    moved = ids.unique().numel() * expert_bytes + 2 * num_tokens * hidden * x.element_size()
    flops = 2 * num_tokens * top_k * 3 * hidden * inter
    return 1e3 * max(moved / HBM_BYTES_PER_S, flops / BF16_FLOPS), moved / 1e9, flops / 1e9


def measure(num_tokens: int, shape: dict, rep_ms: int) -> dict:
    x, w13, w2, weights, ids = problem(num_tokens, **shape)
    config = config_for(num_tokens)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    fused_ms = do_bench(lambda: fused_moe(x, w13, w2, weights, ids), rep=rep_ms)
    reference_ms = do_bench(lambda: moe_reference(x, w13, w2, weights, ids), rep=rep_ms)
    aligned = align(ids, w13.shape[0], config.block_m)
    align_ms = do_bench(lambda: align(ids, w13.shape[0], config.block_m), rep=rep_ms)
    gemms_ms = do_bench(lambda: _launch_gemms(x, w13, w2, weights, *aligned, ids.shape[1], config),
                        rep=rep_ms)
    best_ms, gigabytes, gflop = roofline_ms(x, w13, w2, ids)
    return {"num_tokens": num_tokens, "config": describe(config), "fused_ms": fused_ms,
            "reference_ms": reference_ms, "align_ms": align_ms, "gemms_ms": gemms_ms,
            "speedup_vs_reference": reference_ms / fused_ms, "roofline_ms": best_ms,
            "fraction_of_roofline": best_ms / fused_ms, "gb_moved": gigabytes, "gflop": gflop,
            "experts_hit": ids.unique().numel(),
            "max_abs_error": (out.float() - ref).abs().max().item(),
            "max_abs_ref": ref.abs().max().item()}


def tune(num_tokens: int, shape: dict, rep_ms: int, deadline: float) -> dict:
    """Best (gate_up, down) tiles for each BLOCK_M, each GEMM timed on its own."""
    x, w13, w2, weights, ids = problem(num_tokens, **shape)
    results = {}
    for block_m in (16, 32, 64, 128):
        if block_m > 4 * max(16, num_tokens * shape["top_k"] // shape["num_experts"]):
            continue  # tiles mostly padding
        aligned = align(ids, shape["num_experts"], block_m)
        for kind, grid in (("gate_up", TUNE_GATE_UP), ("down", TUNE_DOWN)):
            for tiles in grid:
                if time.monotonic() > deadline:
                    return results
                fixed = TUNE_DOWN[0] if kind == "gate_up" else TUNE_GATE_UP[0]
                config = MoeConfig(block_m, tiles if kind == "gate_up" else fixed,
                                   tiles if kind == "down" else fixed, group_m=8)
                key = f"{kind} BLOCK_M={block_m} {describe(config)}"
                try:
                    total = do_bench(lambda: _launch_gemms(x, w13, w2, weights, *aligned,
                                                           ids.shape[1], config), rep=rep_ms)
                    results[key] = total
                except Exception as error:  # a config that does not compile or fit: record it
                    results[key] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    return results


def best_of(results: dict) -> dict:
    """The fastest entry per (kind, BLOCK_M); the fixed other GEMM adds the same to each."""
    best = {}
    for key, ms in results.items():
        if isinstance(ms, float):
            group = " ".join(key.split(" ")[:2])  # "gate_up BLOCK_M=16"
            if group not in best or ms < best[group][1]:
                best[group] = (key, ms)
    return {group: {"tiles": key, "ms": ms} for group, (key, ms) in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/fused_moe.json")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768, help="moe_intermediate_size / tp")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rep-ms", type=int, default=50)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tune-budget-s", type=float, default=300)
    args = parser.parse_args()
    shape = dict(hidden=args.hidden, inter=args.inter, num_experts=args.experts, top_k=args.top_k)
    report = {"device": torch.cuda.get_device_name(), "commit": run_info.commit(), "shape": shape,
              "dtype": "bfloat16", "torch": torch.__version__, "triton": triton.__version__,
              "rows": [], "tune": {}}
    print(f"{'tokens':>6} {'fused ms':>9} {'ref ms':>8} {'align':>7} {'gemms':>7} {'speedup':>7} "
          f"{'roofline':>8} {'max err':>8}  config")
    for num_tokens in map(int, args.tokens.split(",")):
        try:
            row = measure(num_tokens, shape, args.rep_ms)
        except Exception as error:  # one failing size must not lose the others
            row = {"num_tokens": num_tokens, "error": f"{type(error).__name__}: {error}"[:500]}
            print(f"{num_tokens:>6} FAILED {row['error']}")
        else:
            print(f"{num_tokens:>6} {row['fused_ms']:9.4f} {row['reference_ms']:8.3f} "
                  f"{row['align_ms']:7.4f} {row['gemms_ms']:7.4f} "
                  f"{row['speedup_vs_reference']:7.1f} {row['fraction_of_roofline']:8.1%} "
                  f"{row['max_abs_error']:8.4f}  {row['config']}")
        report["rows"].append(row)
    if args.tune:
        deadline = time.monotonic() + args.tune_budget_s
        for num_tokens in TUNE_TOKENS:
            results = tune(num_tokens, shape, max(10, args.rep_ms // 2), deadline)
            report["tune"][str(num_tokens)] = {"all": results, "best": best_of(results)}
            for group, best in best_of(results).items():
                print(f"tune tokens={num_tokens} {group}: {best['tiles']} {best['ms']:.4f} ms")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
