"""The decode step's linear layers (Qwen3-0.6B / 8B shapes, bf16, no bias) at skinny batch sizes,
timed the way a decode step runs them: inside a CUDA graph, over COPIES distinct weight copies
(one graph replay = COPIES layers' worth). Eight copies outgrow the H200's ~50 MB L2 except for
the 0.6B o_proj (32 MB) and down (48 MB), whose times may be a little low for it. Reports
microseconds per GEMM, the fraction of the copy bandwidth its weights need, and TFLOP/s, under
each BLAS library torch offers here.

    PYTHONPATH=. python3 bench/gemm.py --out gemm.json
"""

import argparse
import json

import torch

import run_info
from kernels import copy_bandwidth, graph_us

COPIES = 8
ROWS = [8, 32, 64, 128, 256]
# (name, out features, in features): QKV, o_proj, gate_up, down
LAYERS = {"qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                         ("down", 1024, 3072)],
          "qwen3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096),
                       ("down", 4096, 12288)]}


def measure(name: str, n: int, k: int, m: int, copy_bw: float) -> dict:
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(COPIES)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def layers():
        for w in weights:
            torch.mm(x, w.t(), out=out)
    us = graph_us(layers) / COPIES
    moved = 2 * (n * k + m * (n + k))
    return dict(layer=name, n=n, k=k, rows=m, us=us,
                fraction_of_copy_bw=moved / (us * 1e-6) / copy_bw, tflops=2 * m * n * k / us / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  torch=torch.__version__, copy_bandwidth_gbps=copy_bw / 1e9, results=[])
    libraries = ["cublas", "cublaslt"]
    for library in libraries:
        try:
            torch.backends.cuda.preferred_blas_library(library)
        except Exception as e:  # noqa: BLE001 - a library this build lacks is a result
            print(f"{library}: {e}")
            continue
        for model, layers in LAYERS.items():
            for m in ROWS:
                rows = [measure(name, n, k, m, copy_bw) for name, n, k in layers]
                for row in rows:
                    row.update(model=model, library=library)
                report["results"] += rows
                total = sum(r["us"] for r in rows)
                ideal = sum(2 * r["n"] * r["k"] for r in rows) / copy_bw * 1e6
                print(f"{library:9s} {model:11s} M={m:3d}: " + "  ".join(
                    f"{r['layer']} {r['us']:5.1f}us" for r in rows)
                    + f"  layer {total:5.1f} us (weights at copy bandwidth {ideal:4.1f} us)",
                    flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
