"""dataplane/kernels/tma_matmul.py (a GEMM that loads and stores through TMA descriptors, SiLU
in the gated epilogue) against cuBLAS for qkv_proj and gate_up_proj at workload A's large decode
batches. The kernel began here (a24f54a, 8efbae0: it also held a variant with the weights on the
tensor core's wide side, which tied, and o_proj / down_proj on it, which lost in the layer).

1. Each GEMM alone, 28 launches with distinct weights in a CUDA graph, at ROWS: cuBLAS
   (+ silu_and_mul) against every config of CONFIGS, the three fastest again with PDL, each
   checked against cuBLAS's result.
2. The layer as it runs (decode_layer_probe's Layers with the shipped routing, 640-key
   contexts), against the same layer with cuBLAS for qkv_proj and gate_up_proj, and with PDL at
   every launch. Two rounds, interleaved.

`python3 bench/tma_gemm_probe.py $OUT/tma_gemm.json` (PYTHONPATH: the repo and bench/);
`--layer` runs only 2., at LAYER_ROWS (at 160 and 176 rows the shipped routing is cuBLAS's:
there the arms show the probe's noise); `--gate-up`: gate_up_proj + SiLU on it at 48-128 rows,
alone and in the layer as it runs; `--prefill`: gate_up_proj + SiLU on it alone at a prompt
step's 8-16k rows; `--lm-head`: the LM head alone at 8-256 rows; `--check`
runs only a correctness check of every config on small shapes (CPU with TRITON_INTERPRET=1
too).
"""

import contextlib
import itertools
import json
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from dataplane.kernels import pdl
from dataplane.kernels.tma_matmul import tma_matmul, tma_matmul_ref as reference


def smem_bytes(cfg: dict, gated: bool) -> int:
    per_stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"] * (2 if gated else 1)) * cfg["BLOCK_K"] * 2
    return per_stage * cfg["num_stages"] + cfg["BLOCK_M"] * cfg["BLOCK_N"] * 2


SMEM_LIMIT = 220 * 1024
ROWS = [256, 224, 192, 160]
LAYER_ROWS = [160, 176, 192, 208, 224, 240, 256]  # workload A's decode graph sizes there
CONTEXT = 640
# 4 warps (one warpgroup) up to 128-row tiles, 8 for 128 and 256
CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_stages=s, num_warps=w)
           for m, n, k, s, w in itertools.product((64, 128, 256), (32, 64, 128), (64, 128),
                                                  (3, 4), (4, 8))
           if (w == 4) == (m < 256) or m == 128]
SHAPES = {"qkv": (4096, 1024, False), "gate_up": (6144, 1024, True),
          "lm_head": (151936, 1024, False)}  # (N, K, gated)
LM_HEAD_ROWS = [8, 32, 64, 128, 192, 256]
PREFILL_ROWS = [2048, 4096, 8192, 16384]  # a prompt step's tokens (workload A's: 16,384)
# 128- and 256-row tiles, 64-deep K, with and without grouped row tiles (GROUP_M); one
# warpgroup only for 64-column tiles (two 128 x 128 float32 sums would spill from it)
PREFILL_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=64, num_stages=s, num_warps=w, GROUP_M=g)
                   for m, n, s, w, g in itertools.product((128, 256), (64, 128), (3, 4), (4, 8),
                                                          (0, 8))
                   if (w == 8 or m == 128 and n == 64)]


def save(report: dict) -> None:
    """The report so far to the JSON path on the command line (after each shape: a probe cut
    short by its timeout keeps what it measured)."""
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


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


def alone(rows: int, name: str, weights: list[torch.Tensor], x: torch.Tensor,
          configs: list[dict] = CONFIGS, pdl_too: bool = True) -> dict:
    """One GEMM 28 times in a graph: cuBLAS, then each config that fits the shared memory, then
    (pdl_too) the three fastest with PDL; each config's largest difference from cuBLAS's
    result."""
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
            with pdl_at_every_launch(use_pdl):
                us = graph_us(lambda: [tma_matmul(x, w, gated, cfg) for w in weights])
            return entry | dict(us=us / len(weights), max_abs_diff=diff)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            return entry | dict(error=f"{type(e).__name__}: {e}"[:200])

    result = dict(cublas_us=graph_us(cublas) / len(weights), configs=[])
    fitting = [cfg for cfg in configs if smem_bytes(cfg, gated) <= SMEM_LIMIT]
    result["configs"] = [timed(cfg, False) for cfg in fitting]
    fastest = sorted((c for c in result["configs"] if "us" in c), key=lambda c: c["us"])[:3]
    if pdl_too:
        result["configs"] += [timed({k: c[k] for k in configs[0]}, True) for c in fastest]
    ok = sorted((c for c in result["configs"] if "us" in c), key=lambda c: c["us"])
    result["best"] = ok[0]
    top = "; ".join(f"{c['us']:.2f} m{c['BLOCK_M']} n{c['BLOCK_N']} k{c['BLOCK_K']} "
                    f"s{c['num_stages']} w{c['num_warps']} g{c.get('GROUP_M', 0)}"
                    f"{' pdl' if c['pdl'] else ''} (diff {c['max_abs_diff']:.1e})"
                    for c in ok[:3])
    print(f"{rows:3d} rows {name:7s}: cuBLAS {result['cublas_us']:.2f} us; TMA {top}", flush=True)
    return result


@contextlib.contextmanager
def pdl_at_every_launch(on: bool = True) -> Iterator[None]:
    """PDL for launches of any row count while inside (pdl.MAX_ROWS lifted)."""
    default_max_rows = pdl.MAX_ROWS
    pdl.MAX_ROWS = 1 << 30 if on else default_max_rows
    try:
        yield
    finally:
        pdl.MAX_ROWS = default_max_rows


def cublas_column(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    from dataplane.kernels.silu_and_mul import silu_and_mul
    return silu_and_mul(F.linear(x, w)) if gated else F.linear(x, w)


def layer(rows: int, arms: dict[str, Callable | None], context: int = CONTEXT
          ) -> dict[str, list]:
    """The layer as it runs with each arm's column_gemm (None: the shipped routing; an arm
    named *_pdl_all: PDL at every launch); two rounds, interleaved."""
    from decode_layer_probe import LAYERS, Layers
    from kernels import graph_us
    layers = Layers(rows, context)
    result = {arm: [] for arm in arms}
    for _ in range(2):
        for arm, column_gemm in arms.items():
            layers.column_gemm = column_gemm
            with pdl_at_every_launch(arm.endswith("_pdl_all")):
                result[arm].append(graph_us(lambda: layers.step("routed")) / LAYERS)
    print(f"{rows:3d} rows of {context} keys, layer us: " + "; ".join(
        f"{arm} " + " ".join(f"{us:.2f}" for us in runs) for arm, runs in result.items()),
        flush=True)
    return result


LARGE_ARMS = {"shipped": None, "cublas": cublas_column, "shipped_pdl_all": None}


def small_gate_up(report: dict) -> None:
    """gate_up_proj + SiLU on the TMA GEMM at GATE_UP_SHAPES, where cuBLAS + silu_and_mul run it
    (65-128 rows) or the plain decode GEMM + silu_and_mul (33-64): its tiles alone, then the
    layer as it runs against the same with gate_up on the TMA GEMM at its best tile."""
    from decode_layer_probe import GATE_UP_SHAPES, LAYERS, randn, routed_qkv
    n, k, _ = SHAPES["gate_up"]
    for rows, context in GATE_UP_SHAPES:
        weights = [randn(n, k, scale=k ** -0.5) for _ in range(LAYERS)]
        tiles = alone(rows, "gate_up", weights, randn(rows, k),
                      [cfg for cfg in CONFIGS if cfg["BLOCK_M"] <= 128])
        best = {key: tiles["best"][key] for key in CONFIGS[0]}

        def column(x, w, gated):
            return tma_matmul(x, w, gated=True, config=best) if gated else routed_qkv(x, w)

        report["shapes"].append(dict(rows=rows, context=context, alone={"gate_up": tiles},
                                     layer_us=layer(rows, {"shipped": None, "tma": column},
                                                    context)))
        save(report)


def prefill_gate_up(report: dict) -> None:
    """gate_up_proj + SiLU on the TMA GEMM alone at PREFILL_ROWS, where cuBLAS (~93% of the
    dense peak there, profile-prefill-84f0c9d.log) + silu_and_mul run it. The gated epilogue
    saves silu_and_mul's round trip of the [rows, 6144] product, ~71 us of a 16k-token layer:
    it pays if the kernel comes within that of cuBLAS's GEMM. PREFILL_CONFIGS, and the shipped
    choice at each size (tma_matmul_config) where it is not one of them."""
    from decode_layer_probe import LAYERS, randn
    from dataplane.kernels.tma_matmul import tma_matmul_config
    n, k, _ = SHAPES["gate_up"]
    weights = [randn(n, k, scale=k ** -0.5) for _ in range(LAYERS)]
    for rows in PREFILL_ROWS:
        shipped = tma_matmul_config(True, rows)
        configs = PREFILL_CONFIGS + ([] if shipped in PREFILL_CONFIGS else [shipped])
        report["shapes"].append(dict(rows=rows, shipped=shipped, alone={
            "gate_up": alone(rows, "gate_up", weights, randn(rows, k), configs, pdl_too=False)}))
        save(report)


def lm_head(report: dict) -> None:
    """The LM head (Qwen3-0.6B's tied 151,936 x 1024 embedding) alone at LM_HEAD_ROWS, four
    distinct weights of 311 MB (each far past the L2) in the graph."""
    from decode_layer_probe import randn
    n, k, _ = SHAPES["lm_head"]
    weights = [randn(n, k, scale=k ** -0.5) for _ in range(4)]
    for rows in LM_HEAD_ROWS:
        report["shapes"].append(dict(rows=rows, alone={
            "lm_head": alone(rows, "lm_head", weights, randn(rows, k),
                             [cfg for cfg in CONFIGS if cfg["BLOCK_M"] <= max(64, rows)])}))
        save(report)


def main() -> None:
    if "--check" in sys.argv:
        check(on_cpu=not torch.cuda.is_available())
        return
    import run_info
    from decode_layer_probe import LAYERS, randn
    torch.manual_seed(0)
    pdl.set_enabled(True)
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(), shapes=[])
    if "--lm-head" in sys.argv:
        lm_head(report)
        return
    if "--gate-up" in sys.argv:
        small_gate_up(report)
        return
    if "--prefill" in sys.argv:
        prefill_gate_up(report)
        return
    if "--layer" in sys.argv:
        for rows in LAYER_ROWS:
            report["shapes"].append(dict(rows=rows, layer_us=layer(rows, LARGE_ARMS)))
            save(report)
        return
    for rows in ROWS:
        entry = dict(rows=rows, alone={})
        for name, (n, k, _) in list(SHAPES.items())[:2]:
            weights = [randn(n, k, scale=k ** -0.5) for _ in range(LAYERS)]
            entry["alone"][name] = alone(rows, name, weights, randn(rows, k))
        entry["layer_us"] = layer(rows, LARGE_ARMS)
        report["shapes"].append(entry)
        save(report)


if __name__ == "__main__":
    main()
