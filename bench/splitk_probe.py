"""Can a split-K Triton GEMM whose partials the residual-add + RMSNorm kernel sums beat cuBLAS +
that kernel for the decode step's row-parallel layers (o_proj, down_proj; Qwen3-0.6B, and the
larger outputs of Qwen3-30B-A3B's o_proj and Qwen3-8B's)? In CUDA graphs of 28 layers with
distinct weights (as a step meets them), per batch size: cuBLAS's F.linear then
fused_add_rms_norm, against splitk_matmul then fused_add_rms_norm_parts for each tile config
(BLOCK_M: splitk_config's where the config names none); microseconds a layer, and the
partials' error.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/splitk_probe.py $OUT/splitk.json [--sweep]

--sweep: only the 0.6B layers at 160-256 rows (workload A's large batches, where cuBLAS runs them
now) over a wider grid: BLOCK_M 64 or 128, 4 or 8 warps (3 stages throughout).
"""

import itertools
import json
import sys

import torch
import torch.nn.functional as F

import run_info
from kernels import graph_us

from dataplane.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_parts
from dataplane.kernels.splitk_matmul import splitk_matmul

LAYERS = 28
# name: (N, K, batch sizes)
SHAPES = {"0.6b o_proj": (1024, 2048, [1, 8, 32, 64, 128, 256]),
          "0.6b down_proj": (1024, 3072, [1, 8, 32, 64, 128, 256]),
          "30b-a3b o_proj": (2048, 4096, [8, 64, 128]),
          "8b o_proj": (4096, 4096, [8, 64, 128]), "8b down_proj": (4096, 12288, [8, 64, 128])}
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, SPLITS=s, num_warps=4, num_stages=3)
           for n, k, s in itertools.product((64, 128), (64, 128), (2, 4, 8, 16))]
SWEEP_SHAPES = {"0.6b o_proj": (1024, 2048, [160, 192, 256]),
                "0.6b down_proj": (1024, 3072, [160, 192, 256])}
SWEEP_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, SPLITS=s, num_warps=w, num_stages=3)
                 for m, n, k, s, w in itertools.product((64, 128), (64, 128), (64, 128), (2, 4, 8),
                                                        (4, 8))]


def layer_us(step) -> float:
    return graph_us(step) / LAYERS


def measure(n: int, k: int, rows: int, configs: list[dict] = CONFIGS) -> dict:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for _ in range(LAYERS)]
    norm_weight = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

    def cublas(norm: bool):
        for w in weights:
            y = F.linear(x, w)
            if norm:
                fused_add_rms_norm(y, residual, norm_weight, 1e-6)

    result = dict(n=n, k=k, rows=rows, cublas_us=layer_us(lambda: cublas(False)),
                  cublas_norm_us=layer_us(lambda: cublas(True)), configs=[])
    expected = F.linear(x, weights[0]).float()
    for cfg in configs:
        if k % (cfg["SPLITS"] * cfg["BLOCK_K"]):
            continue
        parts = torch.empty(cfg["SPLITS"], rows, n, device="cuda", dtype=torch.float32)

        def splitk(norm: bool):
            for w in weights:
                splitk_matmul(x, w, config=cfg, out=parts)
                if norm:
                    fused_add_rms_norm_parts(parts, residual, norm_weight, 1e-6)

        try:
            gemm = layer_us(lambda: splitk(False))
            both = layer_us(lambda: splitk(True))
            splitk_matmul(x, weights[0], config=cfg, out=parts)
            error = (parts.sum(0) - expected).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            result["configs"].append(dict(cfg, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        result["configs"].append(dict(cfg, splitk_us=gemm, splitk_norm_us=both,
                                      max_abs_error=error))
    return result


def main() -> None:
    torch.manual_seed(0)
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(), shapes=[])
    swept = "--sweep" in sys.argv
    for name, (n, k, batch_sizes) in (SWEEP_SHAPES if swept else SHAPES).items():
        for rows in batch_sizes:
            r = measure(n, k, rows, SWEEP_CONFIGS if swept else CONFIGS) | dict(layer=name)
            report["shapes"].append(r)
            ok = [c for c in r["configs"] if "splitk_norm_us" in c]
            best = min(ok, key=lambda c: c["splitk_norm_us"])
            print(f"{name:15s} {rows:3d} rows: cuBLAS {r['cublas_us']:.2f} us, + norm "
                  f"{r['cublas_norm_us']:.2f}; split-K best {best['splitk_us']:.2f}, + norm "
                  f"{best['splitk_norm_us']:.2f} ({ {k: v for k, v in best.items() if k.isupper()} } "
                  f"warps {best['num_warps']}; error {best['max_abs_error']:.1e})",
                  flush=True)
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
