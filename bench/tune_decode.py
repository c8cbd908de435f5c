"""Decode attention on the shapes workload A's decode steps see (DESIGN.md): batches of 8 to 256
requests whose contexts differ (uniform in a range), not the equal lengths of kernels.py. For
each shape: the default launch (the split count a CUDA graph captured at --max-model-len picks),
each tile config in CONFIGS, then every split count with the best config. (The run in
bench/results/h200/decode_tuning.json, at a9cdbf6, also tried both grid orders: HEADS_FIRST.)

    PYTHONPATH=. python3 bench/tune_decode.py --out decode_tuning.json
"""

import argparse
import json
import random
import time

import torch
import triton

import run_info
from kernels import BLOCK, HEAD_DIM, MODELS, NUM_KV_HEADS, bench_ms, copy_bandwidth, kv_bytes, \
    paged_problem

from dataplane.kernels.paged_decode_attention import paged_decode_attention, pick_num_splits

# (model, requests, shortest context, longest context)
SHAPES = [("qwen3-0.6b", 256, 100, 1100), ("qwen3-0.6b", 192, 300, 1500),
          ("qwen3-0.6b", 128, 500, 1500), ("qwen3-0.6b", 64, 600, 1700),
          ("qwen3-0.6b", 32, 500, 1500), ("qwen3-0.6b", 8, 800, 2000),
          ("qwen3-8b", 256, 100, 1100), ("qwen3-8b", 64, 600, 1700)]
CONFIGS = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
           [(32, 2, 4), (32, 4, 3), (32, 4, 4), (64, 2, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4),
            (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3)]]
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16]


def measure(args: tuple, splits: int, config: dict, moved: int, copy_bw: float) -> dict:
    run = lambda: paged_decode_attention(*args, num_splits=splits, config=config)  # noqa: E731
    try:
        run()
        ms = bench_ms(run, rep=40)
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: a result, not a crash
        return dict(num_splits=splits, config=config, error=f"{type(e).__name__}: {e}"[:200])
    return dict(num_splits=splits, config=config, ms=ms,
                fraction_of_copy_bw=moved / (ms * 1e-3) / copy_bw)


def problem(model: str, rows: int, lo: int, hi: int, max_model_len: int
            ) -> tuple[tuple, list[int], int]:
    """A decode batch of `rows` requests with contexts uniform in [lo, hi]: the kernel's
    arguments, the contexts and the split count a graph captured at max_model_len picks."""
    rng = random.Random(rows)
    contexts = [rng.randint(lo, hi) for _ in range(rows)]
    p = paged_problem([1] * rows, [c - 1 for c in contexts], MODELS[model], BLOCK)
    args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
            HEAD_DIM ** -0.5)
    return args, contexts, pick_num_splits(rows, NUM_KV_HEADS, max_model_len, p["q"].device)


def run_once(rows: int, max_model_len: int) -> None:
    """The default launch on the 0.6B shape of SHAPES with `rows` requests, ten times and
    untimed: for a profiler (gpu_run.sh ncu-decode) to look at one launch."""
    model, _, lo, hi = next(s for s in SHAPES if s[0] == "qwen3-0.6b" and s[1] == rows)
    args, _, splits = problem(model, rows, lo, hi, max_model_len)
    for _ in range(10):
        paged_decode_attention(*args, num_splits=splits)
    torch.cuda.synchronize()


def tune_shape(model: str, rows: int, lo: int, hi: int, max_model_len: int,
               copy_bw: float) -> dict:
    args, contexts, default_splits = problem(model, rows, lo, hi, max_model_len)
    moved = kv_bytes(contexts)
    default = measure(args, default_splits, {}, moved, copy_bw)
    tried = [measure(args, default_splits, c, moved, copy_bw) for c in CONFIGS]
    best = min((r for r in tried if "ms" in r), key=lambda r: r["ms"])
    tried += [measure(args, s, best["config"], moved, copy_bw) for s in SPLITS]
    best = min((r for r in tried if "ms" in r), key=lambda r: r["ms"])
    return dict(model=model, rows=rows, contexts=[lo, hi], context_tokens=sum(contexts),
                default=default, best=best, tried=tried)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="the bound decode graphs are captured with (bench/throughput.py's)")
    parser.add_argument("--once", type=int, default=None, metavar="ROWS",
                        choices=[rows for model, rows, _, _ in SHAPES if model == "qwen3-0.6b"],
                        help="only launch the default config on that 0.6B shape, untimed (for ncu)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.once is not None:
        run_once(args.once, args.max_model_len)
        return
    if args.out is None:
        parser.error("--out is required unless --once")
    started = time.time()
    copy_bw = copy_bandwidth()
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  torch=torch.__version__, triton=triton.__version__, block_size=BLOCK,
                  copy_bandwidth_gbps=copy_bw / 1e9, max_model_len=args.max_model_len,
                  shapes=[])
    for model, rows, lo, hi in SHAPES:
        shape = tune_shape(model, rows, lo, hi, args.max_model_len, copy_bw)
        report["shapes"].append(shape)
        d, b = shape["default"], shape["best"]
        print(f"{model} {rows} rows [{lo}, {hi}]: default {d['num_splits']} splits "
              f"{d['ms'] * 1e3:.1f} us ({100 * d['fraction_of_copy_bw']:.1f}%); best "
              f"{b['num_splits']} splits {b['config']} {b['ms'] * 1e3:.1f} us "
              f"({100 * b['fraction_of_copy_bw']:.1f}%)", flush=True)
        report["seconds"] = time.time() - started
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
