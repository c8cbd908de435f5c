"""Decode attention on the shapes workload A's decode steps see (DESIGN.md): batches of 8 to 256
requests whose contexts differ (uniform in a range), not the equal lengths of kernels.py. For
each shape: the default launch (the plan a forward builds), each kernel config in CONFIGS, then
each count of programs per SM with the best config; and the plan kernel's own time (built once
a forward, shared by every layer). (The run in bench/results/h200/decode_tuning.json, at
a9cdbf6, tuned the earlier split-KV kernel: tiles, grid orders and split counts.)

    PYTHONPATH=. python3 bench/tune_decode.py --out decode_tuning.json [--pages]

--pages: only the default launch, on 16-, 32-, 64- and 128-token pages, each size with the
pages shuffled over the requests (as a long run's decode blocks end up) and with each request's
pages adjacent in order: whether what 128-token blocks gain in workload A's decode steps
(bench/README's thirtieth session) comes from the pages' size or from where they lie.
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

from dataplane.kernels.paged_decode_attention import paged_decode_attention, plan_decode

# (model, requests, shortest context, longest context)
SHAPES = [("qwen3-0.6b", 256, 100, 1100), ("qwen3-0.6b", 192, 300, 1500),
          ("qwen3-0.6b", 128, 500, 1500), ("qwen3-0.6b", 64, 600, 1700),
          ("qwen3-0.6b", 32, 500, 1500), ("qwen3-0.6b", 8, 800, 2000),
          ("qwen3-8b", 256, 100, 1100), ("qwen3-8b", 64, 600, 1700)]
CONFIGS = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
           [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2),
            (128, 8, 3)]]
PROGRAMS_PER_SM = [1, 2, 3, 4, 6, 8]
PAGE_LAYOUTS = [(size, shuffled) for size in (BLOCK, 32, 64, 128) for shuffled in (True, False)]


def measure(args: tuple, programs_per_sm: int | None, config: dict, moved: int,
            copy_bw: float) -> dict:
    """The kernel alone (its plan built beforehand, as the layers after the first find it)."""
    q, k_cache, _, block_tables, seq_lens, _ = args
    num_programs = None
    if programs_per_sm is not None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_programs = -(-sms * programs_per_sm // NUM_KV_HEADS)
    result = dict(programs_per_sm=programs_per_sm, config=config)
    try:
        plan = plan_decode(q, k_cache, block_tables, seq_lens, num_programs=num_programs,
                           block_n=config.get("BLOCK_N"))
        kernel = {k: v for k, v in config.items() if k != "BLOCK_N"}
        run = lambda: paged_decode_attention(*args, plan=plan, config=kernel)  # noqa: E731
        run()
        ms = bench_ms(run, rep=40)
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: a result, not a crash
        return result | dict(error=f"{type(e).__name__}: {e}"[:200])
    return result | dict(ms=ms, fraction_of_copy_bw=moved / (ms * 1e-3) / copy_bw)


def batch_contexts(rows: int, lo: int, hi: int) -> list[int]:
    """The contexts of a decode batch of `rows` requests, uniform in [lo, hi] (seeded by rows)."""
    rng = random.Random(rows)
    return [rng.randint(lo, hi) for _ in range(rows)]


def problem(model: str, rows: int, lo: int, hi: int, block_size: int = BLOCK,
            shuffled: bool = True) -> tuple[tuple, list[int]]:
    """A decode batch of `rows` requests with contexts uniform in [lo, hi]: the kernel's
    arguments and the contexts."""
    contexts = batch_contexts(rows, lo, hi)
    p = paged_problem([1] * rows, [c - 1 for c in contexts], MODELS[model], block_size,
                      shuffled)
    args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
            HEAD_DIM ** -0.5)
    return args, contexts


def run_once(rows: int) -> None:
    """The default launch on the 0.6B shape of SHAPES with `rows` requests, ten times and
    untimed: for a profiler (gpu_run.sh ncu-decode) to look at one launch."""
    model, _, lo, hi = next(s for s in SHAPES if s[0] == "qwen3-0.6b" and s[1] == rows)
    args, _ = problem(model, rows, lo, hi)
    plan = plan_decode(*args[:2], *args[3:5])
    for _ in range(10):
        paged_decode_attention(*args, plan=plan)
    torch.cuda.synchronize()


def tune_shape(model: str, rows: int, lo: int, hi: int, copy_bw: float) -> dict:
    args, contexts = problem(model, rows, lo, hi)
    moved = kv_bytes(contexts)
    default = measure(args, None, {}, moved, copy_bw)
    tried = [measure(args, None, c, moved, copy_bw) for c in CONFIGS]
    best = min((r for r in tried if "ms" in r), key=lambda r: r["ms"])
    tried += [measure(args, n, best["config"], moved, copy_bw) for n in PROGRAMS_PER_SM]
    best = min((r for r in tried if "ms" in r), key=lambda r: r["ms"])
    plan_ms = bench_ms(lambda: plan_decode(*args[:2], *args[3:5]), rep=40)
    return dict(model=model, rows=rows, contexts=[lo, hi], context_tokens=sum(contexts),
                default=default, best=best, plan_ms=plan_ms, tried=tried)


def pages_shape(model: str, rows: int, lo: int, hi: int, copy_bw: float) -> dict:
    """The default launch on each of PAGE_LAYOUTS."""
    layouts = []
    for block_size, shuffled in PAGE_LAYOUTS:
        args, contexts = problem(model, rows, lo, hi, block_size, shuffled)
        layouts.append(dict(block_size=block_size, shuffled=shuffled,
                            **measure(args, None, {}, kv_bytes(contexts), copy_bw)))
    return dict(model=model, rows=rows, contexts=[lo, hi], layouts=layouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--once", type=int, default=None, metavar="ROWS",
                        choices=[rows for model, rows, _, _ in SHAPES if model == "qwen3-0.6b"],
                        help="only launch the default config on that 0.6B shape, untimed (for ncu)")
    parser.add_argument("--pages", action="store_true",
                        help="only the default launch on 16- to 128-token pages, shuffled or not")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.once is not None:
        run_once(args.once)
        return
    if args.out is None:
        parser.error("--out is required unless --once")
    started = time.time()
    copy_bw = copy_bandwidth()
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  torch=torch.__version__, triton=triton.__version__, block_size=BLOCK,
                  copy_bandwidth_gbps=copy_bw / 1e9,
                  shapes=[])
    for model, rows, lo, hi in SHAPES:
        if args.pages:
            shape = pages_shape(model, rows, lo, hi, copy_bw)
            line = "; ".join(f"{r['block_size']}-token pages "
                             f"{'shuffled' if r['shuffled'] else 'in order'} {_timing(r)}"
                             for r in shape["layouts"])
        else:
            shape = tune_shape(model, rows, lo, hi, copy_bw)
            d, b = shape["default"], shape["best"]
            line = (f"default {_timing(d)}; best {b['programs_per_sm']} programs/SM "
                    f"{b['config']} {_timing(b)}; plan {shape['plan_ms'] * 1e3:.1f} us")
        print(f"{model} {rows} rows [{lo}, {hi}]: {line}", flush=True)
        report["shapes"].append(shape)
        report["seconds"] = time.time() - started
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def _timing(row: dict) -> str:
    if "ms" not in row:
        return row["error"]
    return f"{row['ms'] * 1e3:.1f} us ({100 * row['fraction_of_copy_bw']:.1f}%)"


if __name__ == "__main__":
    main()
