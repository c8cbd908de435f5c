"""What programmatic dependent launch buys between small kernels: chains of our kernels replayed
as CUDA graphs (and launched eagerly), with PDL on and off, in microseconds per kernel.

    PYTHONPATH=. python3 bench/pdl.py --out pdl.json
"""

import argparse
import json

import torch

import run_info
from gemm import graph_us

from dataplane.kernels import pdl
from dataplane.kernels.rmsnorm import rms_norm
from dataplane.kernels.skinny_matmul import CONFIGS, fits, skinny_matmul

CHAIN = 64


def eager_us(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def chains(rows: int) -> dict:
    """name -> (fn, kernels per call)."""
    hidden, out_features = 1024, 2048  # Qwen3-0.6B's o_proj, transposed: [2048, 1024]
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    norm_weight = torch.ones(hidden, dtype=x.dtype, device="cuda")
    normed = torch.empty_like(x)
    weights = [torch.randn(out_features, hidden, dtype=x.dtype, device="cuda") * 0.03
               for _ in range(8)]
    out = torch.empty(rows, out_features, dtype=x.dtype, device="cuda")
    config = next(c for c in CONFIGS if fits(c, rows, out_features, hidden, 2))
    return {
        "norm": (lambda: [rms_norm(x, norm_weight, 1e-6, out=normed) for _ in range(CHAIN)],
                 CHAIN),
        "norm+cublas": (lambda: [(rms_norm(x, norm_weight, 1e-6, out=normed),
                                  torch.mm(normed, weights[i % 8].t(), out=out))
                                 for i in range(CHAIN)], 2 * CHAIN),
        "norm+skinny": (lambda: [(rms_norm(x, norm_weight, 1e-6, out=normed),
                                  skinny_matmul(normed, weights[i % 8], config, out))
                                 for i in range(CHAIN)], 2 * CHAIN),
        "skinny": (lambda: [skinny_matmul(x, weights[i % 8], config, out)
                            for i in range(CHAIN)], CHAIN),
        "cublas": (lambda: [torch.mm(x, weights[i % 8].t(), out=out) for i in range(CHAIN)],
                   CHAIN),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(), results=[])
    for rows in (1, 64, 256):
        for on in (False, True):
            pdl.set_enabled(on)
            for name, (fn, kernels) in chains(rows).items():
                row = dict(rows=rows, pdl=on, chain=name,
                           graph_us_per_kernel=graph_us(fn) / kernels,
                           eager_us_per_kernel=eager_us(fn) / kernels)
                report["results"].append(row)
                print(f"rows {rows:3d} pdl {on!s:5s} {name:12s} graph "
                      f"{row['graph_us_per_kernel']:5.2f} us/kernel, eager "
                      f"{row['eager_us_per_kernel']:5.2f}", flush=True)
    pdl.set_enabled(True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
