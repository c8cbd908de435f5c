"""Does a decode layer whose kernels are all ours, launched with programmatic dependent launch,
beat the one with cuBLAS's qkv_proj and gate_up_proj? Qwen3-0.6B shapes, CUDA graphs of 28
layers with distinct weights (as a step meets them), per batch size:

1. decode_matmul (qkv_proj; gate_up_proj with SiLU-and-mul in its epilogue) for each tile
   config, alone in a graph of 28 launches, against cuBLAS (+ silu_and_mul);
2. the whole layer (residual add + RMSNorm, qkv, q/k norm + RoPE + K/V store, decode attention
   over 128-key contexts, o_proj, RMSNorm, gate_up + SiLU, down_proj) with cuBLAS or
   decode_matmul at its best config, each with and without PDL;
3. at 160 and 256 rows of 640-key contexts (workload A's large batches): the layer as it runs
   (cuBLAS, no PDL above pdl.MAX_ROWS), with PDL at every launch, and with PDL and the split-K
   o_proj / down_proj (splitk_matmul.MAX_ROWS lifted).

Microseconds a layer. `python3 bench/decode_layer_probe.py $OUT/decode_layer.json`
(PYTHONPATH: the repo and bench/). With `--sweep` it runs only 1. at 64-256 rows over a wider
grid (BLOCK_M up to 128, 8 warps, 4 stages): tiles for workload A's large batches. With
`--gate-up` it runs only the layer as it runs at 48-128 rows, gate_up_proj on our plain GEMM
(then silu_and_mul) against cuBLAS's. With `--stages` it runs only the layer as it runs at
8-128 rows with deeper software pipelines in our GEMMs (decode_matmul's and splitk_matmul's
num_stages and BLOCK_K): at these sizes a GEMM streams its weights at a third of the copy
bandwidth, as if its loads in flight did not cover the memory's latency. `--long-stages`: at
160-256 rows, split-K o_proj/down_proj at 3-5 stages against the shipped cuBLAS.
"""

import itertools
import json
import sys

import torch
import torch.nn.functional as F

import run_info
from kernels import graph_us

from dataplane.kernels import pdl
from dataplane.kernels.decode_matmul import decode_matmul, decode_matmul_pays, decode_matmul_ref
from dataplane.kernels.paged_decode_attention import paged_decode_attention, plan_decode
from dataplane.kernels.qk_norm_rope import qk_norm_rope_store
from dataplane.kernels.silu_and_mul import silu_and_mul
from dataplane.kernels.splitk_matmul import splitk_matmul, splitk_pays
from dataplane.kernels.tma_matmul import tma_matmul, tma_matmul_pays
from dataplane.layers.layernorm import RMSNorm

LAYERS = 28
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 128, 3072
BLOCK_SIZE = 16
ROWS = [8, 32]  # 128-key contexts (865485f: 1, 8, 32, 64, 128, 256)
LONG = [(160, 640), (256, 640)]  # (rows, keys)
DTYPE = torch.bfloat16
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=3)
           for n, k in itertools.product((32, 64, 128), (64, 128))]  # BLOCK_M: by the rows
SWEEP_ROWS = [64, 128, 160, 192, 256]
GATE_UP_SHAPES = [(48, 1024), (64, 1024), (96, 896), (128, 768)]  # (rows, keys): workload A's
SWEEP_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                 for m, n, k, w, s in itertools.product((64, 128), (64, 128), (64, 128), (4, 8),
                                                        (3, 4))]


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(DTYPE)


class Layers:
    """28 layers' weights and one batch's activations, KV cache and attention plan."""

    def __init__(self, rows: int, context: int = 128) -> None:
        qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = [randn(qkv_n, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(LAYERS)]
        self.o = [randn(HIDDEN, HEADS * HEAD_DIM, scale=2048 ** -0.5) for _ in range(LAYERS)]
        self.gate_up = [randn(2 * INTERMEDIATE, HIDDEN, scale=HIDDEN ** -0.5)
                        for _ in range(LAYERS)]
        self.down = [randn(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE ** -0.5)
                     for _ in range(LAYERS)]
        self.norm = RMSNorm(HIDDEN, 1e-6).to("cuda", DTYPE)  # what the layers run
        self.head_norm = torch.ones(HEAD_DIM, device="cuda", dtype=DTYPE)
        self.rows = rows
        self.x = randn(rows, HIDDEN)
        self.residual = randn(rows, HIDDEN)
        blocks = context // BLOCK_SIZE
        self.k_cache = randn(rows * blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.v_cache = randn(rows * blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.block_tables = torch.arange(rows * blocks, device="cuda", dtype=torch.int32
                                         ).view(rows, blocks)
        self.seq_lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
        self.positions = torch.full((rows,), context - 1, device="cuda", dtype=torch.int64)
        self.splitk = False  # split-K row-parallel layers at any batch size
        self.split_depth = None  # split-K with K // split_depth splits (None: splitk_config's)
        self.plain_gate_up = None  # "routed": gate_up on the plain GEMM (None: as the layer)
        # "routed": (x, w, gated) -> qkv_proj's or gate_up_proj + SiLU's output at any row
        # count, over the layers' routing (None: their routing)
        self.column_gemm = None
        self.slots = (self.block_tables[:, -1].long() * BLOCK_SIZE + BLOCK_SIZE - 1)
        self.cos_sin = torch.randn(context, HEAD_DIM, device="cuda")
        self.q_like = torch.empty(rows, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)

    def step(self, ours: dict | str | None) -> None:
        """One step's 28 layers; ours: the decode_matmul configs (qkv, gate_up), "routed" for
        the layers' own choice by batch size (decode_matmul_pays), or None for cuBLAS."""
        plan = plan_decode(self.q_like, self.k_cache, self.block_tables, self.seq_lens)
        hidden, residual = self.x, self.residual.clone()
        for i in range(LAYERS):
            hidden, residual = self.norm(hidden, residual)
            if ours == "routed":
                qkv = self.column(hidden, self.qkv[i], gated=False)
            elif ours:
                qkv = decode_matmul(hidden, self.qkv[i], config=ours["qkv"])
            else:
                qkv = F.linear(hidden, self.qkv[i])
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            q = qk_norm_rope_store(
                self.positions, q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM),
                v.view(-1, KV_HEADS, HEAD_DIM), self.head_norm, self.head_norm, 1e-6,
                self.cos_sin, self.k_cache, self.v_cache, self.slots)
            attn = paged_decode_attention(q, self.k_cache, self.v_cache, self.block_tables,
                                          self.seq_lens, HEAD_DIM ** -0.5, plan=plan)
            hidden = self.row_parallel(attn.flatten(1), self.o[i])
            hidden, residual = self.norm(hidden, residual)
            if ours == "routed":
                act = self.column(hidden, self.gate_up[i], gated=True)
            elif ours:
                act = decode_matmul(hidden, self.gate_up[i], gated=True, config=ours["gate_up"])
            else:
                act = silu_and_mul(F.linear(hidden, self.gate_up[i]))
            hidden = self.row_parallel(act, self.down[i])
        self.norm(hidden, residual)

    def column(self, x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
        """qkv_proj (gated False) or gate_up_proj + SiLU: column_gemm, or the layers' routing."""
        if self.column_gemm is not None:
            return self.column_gemm(x, w, gated)
        return self.routed_gate_up(x, w) if gated else routed_qkv(x, w)

    def routed_gate_up(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """What MergedColumnParallelLinear.silu_and_mul runs for x's rows; plain_gate_up True or
        False: the plain GEMM or cuBLAS wherever the gated kernels do not pay, past
        decode_matmul_pays's bound for it (up to the plain kernel's own)."""
        rows = x.shape[0]
        if decode_matmul_pays(rows, INTERMEDIATE, HIDDEN, DTYPE, gated=True):
            return decode_matmul(x, w, gated=True)
        if tma_matmul_pays(x, INTERMEDIATE, HIDDEN, gated=True):
            return tma_matmul(x, w, gated=True)
        forced = self.plain_gate_up is not None
        if (self.plain_gate_up is not False and decode_matmul_pays(
                rows, 2 * INTERMEDIATE, HIDDEN, DTYPE, before_silu=not forced)):
            return silu_and_mul(decode_matmul(x, w))
        return silu_and_mul(F.linear(x, w))

    def row_parallel(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """What RowParallelLinear(feeds_norm=True) runs on one GPU (with splitk: split-K
        whatever the batch size)."""
        if self.splitk or splitk_pays(x.shape[0], *w.shape, x.dtype):
            depth = self.split_depth
            return splitk_matmul(x, w, config=depth and dict(SPLITS=w.shape[1] // depth))
        return F.linear(x, w)


def routed_qkv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What QKVParallelLinear runs for x's rows."""
    if decode_matmul_pays(x.shape[0], *w.shape, DTYPE):
        return decode_matmul(x, w)
    if tma_matmul_pays(x, *w.shape):
        return tma_matmul(x, w)
    return F.linear(x, w)


def gemm_alone(layers: Layers, name: str, configs: list[dict] = CONFIGS) -> dict:
    """qkv_proj or gate_up_proj (+ SiLU) alone: cuBLAS, then each config (BLOCK_M by the rows
    where it names none), with PDL."""
    weights = layers.qkv if name == "qkv" else layers.gate_up
    gated = name == "gate_up"
    x = layers.x

    def cublas():
        for w in weights:
            y = F.linear(x, w)
            if gated:
                silu_and_mul(y)

    result = dict(cublas_us=graph_us(cublas) / LAYERS, configs=[])
    expected = decode_matmul_ref(x, weights[0], gated)
    for cfg in configs:
        cfg = dict(BLOCK_M=min(64, max(16, 1 << (layers.rows - 1).bit_length()))) | cfg
        try:
            us = graph_us(lambda: [decode_matmul(x, w, gated=gated, config=cfg)
                                   for w in weights]) / LAYERS
            error = (decode_matmul(x, weights[0], gated=gated, config=cfg).float()
                     - expected.float()).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            result["configs"].append(dict(cfg, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        result["configs"].append(dict(cfg, us=us, max_abs_diff=error))
    ok = [c for c in result["configs"] if "us" in c]
    result["best"] = min(ok, key=lambda c: c["us"])
    return result


def strip(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("us", "max_abs_diff")}


def sweep(report: dict) -> None:
    """The two GEMMs alone at SWEEP_ROWS over SWEEP_CONFIGS (PDL as the step runs them)."""
    for rows in SWEEP_ROWS:
        layers = Layers(rows)
        pdl.set_enabled(True)
        alone = {name: gemm_alone(layers, name, SWEEP_CONFIGS) for name in ("qkv", "gate_up")}
        report["shapes"].append(dict(rows=rows, alone=alone))
        for name, r in alone.items():
            top = sorted((c for c in r["configs"] if "us" in c), key=lambda c: c["us"])[:3]
            print(f"{rows:3d} rows {name:7s}: cuBLAS {r['cublas_us']:.2f} us; ours " + "; ".join(
                f"{c['us']:.2f} {strip(c)} (diff {c['max_abs_diff']:.1e})" for c in top),
                flush=True)
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)


def main() -> None:
    torch.manual_seed(0)
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(), shapes=[])
    modes = {"--sweep": sweep, "--gate-up": plain_gate_up, "--stages": stages,
             "--long-stages": long_stages}
    for flag, mode in modes.items():
        if flag in sys.argv:
            mode(report)
            return
    for rows in ROWS:
        layers = Layers(rows)
        pdl.set_enabled(True)
        alone = {name: gemm_alone(layers, name) for name in ("qkv", "gate_up")}
        ours = {name: strip(alone[name]["best"]) for name in alone}
        chain = {}
        for use_pdl, mine in itertools.product((False, True), (False, True)):
            pdl.set_enabled(use_pdl)
            key = ("ours" if mine else "cublas") + ("_pdl" if use_pdl else "")
            chain[key] = graph_us(lambda: layers.step(ours if mine else None)) / LAYERS
        pdl.set_enabled(True)
        report["shapes"].append(dict(rows=rows, alone=alone, layer_us=chain))
        print(f"{rows:3d} rows: qkv cuBLAS {alone['qkv']['cublas_us']:.2f} us, ours "
              f"{alone['qkv']['best']['us']:.2f} {ours['qkv']}; gate_up+SiLU cuBLAS "
              f"{alone['gate_up']['cublas_us']:.2f}, ours {alone['gate_up']['best']['us']:.2f} "
              f"{ours['gate_up']}", flush=True)
        print("    layer us: " + ", ".join(f"{k} {v:.2f}" for k, v in chain.items()), flush=True)
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    for rows, context in LONG:
        layer_us = long_layer(rows, context)
        report["shapes"].append(dict(rows=rows, context=context, layer_us=layer_us))
        print(f"{rows:3d} rows of {context} keys, layer us: " + ", ".join(
            f"{k} {v:.2f}" for k, v in report["shapes"][-1]["layer_us"].items()), flush=True)
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)


def record_arms(report: dict, rows: int, context: int, result: dict[str, list]) -> None:
    """One shape's us a layer by arm (a run that failed: its error), printed and saved."""
    report["shapes"].append(dict(rows=rows, context=context, layer_us=result))
    print(f"{rows:3d} rows of {context} keys, layer us: " + "; ".join(
        f"{arm} " + " ".join(f"{us:.2f}" if isinstance(us, float) else us[:60] for us in runs)
        for arm, runs in result.items()), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


def plain_gate_up(report: dict) -> None:
    """The layer as it runs (the shipped routing and PDL) at GATE_UP_SHAPES, gate_up_proj on the
    plain decode GEMM + silu_and_mul against cuBLAS + silu_and_mul; three rounds, alternating."""
    for rows, context in GATE_UP_SHAPES:
        layers = Layers(rows, context)
        result = {"cublas": [], "plain": []}
        for _ in range(3):
            for arm in result:
                layers.plain_gate_up = arm == "plain"
                result[arm].append(graph_us(lambda: layers.step("routed")) / LAYERS)
        record_arms(report, rows, context, result)


STAGE_SHAPES = [(8, 1024), (32, 1024), (64, 1024), (128, 768)]  # (rows, keys): workload A's
# (name, over decode_matmul's config up to SMALL_TILE_ROWS, over its wider rows' config, over
# splitk_matmul's, SPLIT_DEPTH among them: Layers.split_depth): the shipped configs came from the first sets of arms
# (decode_layer_stages-dd6468b.json, -d68aadb.json: 3-8 stages, 64- or 128-deep K tiles;
# -29a85a8.json: split-K's splits by depth). These put all of a program's K in flight in
# the decode GEMM: narrower strips (32 columns, twice the programs) in deeper pipelines.
STAGE_ARMS = [("shipped", {}, {}, {}),
              ("small_n32_k64_s16", dict(BLOCK_N=32, BLOCK_K=64, num_stages=16), {}, {}),
              ("small_n32_k128_s8", dict(BLOCK_N=32, BLOCK_K=128, num_stages=8), {}, {}),
              ("small_n32_k64_s8", dict(BLOCK_N=32, BLOCK_K=64, num_stages=8), {}, {}),
              ("wide_n32_s8", {}, dict(BLOCK_N=32, num_stages=8), {}),
              ("wide_n32_s4", {}, dict(BLOCK_N=32), {})]


# 129-256 rows, where the row-parallel layers run on cuBLAS (splitk_matmul.MAX_ROWS): split-K
# there too, at 3-5 stages (its 3-stage sweep had it within 0.5 us of cuBLAS: 2a21cfb)
LONG_STAGE_SHAPES = [(160, 640), (192, 640), (256, 640)]
LONG_STAGE_ARMS = [("shipped", None), ("sk_all_s3", 3), ("sk_all_s4", 4), ("sk_all_s5", 5)]


def long_stages(report: dict) -> None:
    """The layer as it runs at LONG_STAGE_SHAPES, and with split-K at every batch size in each
    of LONG_STAGE_ARMS's stage counts; two rounds, interleaved."""
    from dataplane.kernels import splitk_matmul as sk
    shipped_stages, shipped_max_rows = sk._CONFIG["num_stages"], sk.MAX_ROWS
    for rows, context in LONG_STAGE_SHAPES:
        layers = Layers(rows, context)
        result = {name: [] for name, _ in LONG_STAGE_ARMS}
        for _ in range(2):
            for name, num_stages in LONG_STAGE_ARMS:
                if num_stages is not None:
                    sk.MAX_ROWS, sk._CONFIG["num_stages"] = 1 << 30, num_stages
                try:
                    result[name].append(graph_us(lambda: layers.step("routed")) / LAYERS)
                finally:
                    sk.MAX_ROWS, sk._CONFIG["num_stages"] = shipped_max_rows, shipped_stages
        record_arms(report, rows, context, result)


def stages(report: dict) -> None:
    """The layer as it runs at STAGE_SHAPES with each of STAGE_ARMS's settings written over the
    kernels' shipped configs (restored after), two rounds, interleaved."""
    from dataplane.kernels import decode_matmul as mm, splitk_matmul as sk
    shipped = [(cfg, dict(cfg)) for cfg in (mm._CONFIG, mm._WIDE_CONFIG, sk._CONFIG)]
    pdl.set_enabled(True)
    for rows, context in STAGE_SHAPES:
        layers = Layers(rows, context)
        result = {name: [] for name, *_ in STAGE_ARMS}
        for _ in range(2):
            for name, small_over, wide_over, sk_over in STAGE_ARMS:
                mm._CONFIG.update(small_over)
                mm._WIDE_CONFIG.update(wide_over)
                sk_over = dict(sk_over)
                layers.split_depth = sk_over.pop("SPLIT_DEPTH", None)
                sk._CONFIG.update(sk_over)
                try:
                    result[name].append(graph_us(lambda: layers.step("routed")) / LAYERS)
                except Exception as e:  # noqa: BLE001 - out of shared memory: a result
                    result[name].append(f"{type(e).__name__}: {e}"[:200])
                finally:
                    layers.split_depth = None
                    for cfg, original in shipped:
                        cfg.clear()
                        cfg.update(original)
        record_arms(report, rows, context, result)


def long_layer(rows: int, context: int) -> dict:
    layers = Layers(rows, context)
    result = dict(as_runs=graph_us(lambda: layers.step(None)) / LAYERS)
    default_max_rows = pdl.MAX_ROWS
    pdl.MAX_ROWS = 1 << 30
    try:
        result["pdl_all_rows"] = graph_us(lambda: layers.step(None)) / LAYERS
        layers.splitk = True
        result["pdl_all_rows_splitk"] = graph_us(lambda: layers.step(None)) / LAYERS
    finally:
        pdl.MAX_ROWS = default_max_rows
    return result


if __name__ == "__main__":
    main()
