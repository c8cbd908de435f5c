"""Prefill attention configs on the prompt steps workload A runs (DESIGN.md): 16,384 new tokens
of prompts uniform in [100, 1024] (seed 0; the last one cut to fit), no cached tokens, and
for comparison on two prompts of 8,192 and on eight 2,048-token chunks after 4,096 cached
tokens each; Qwen3-0.6B and Qwen3-8B heads. For each: the default config (the one a step
launches), then each config of the grid; time, TFLOP/s (causal), and the best. Beside them, on
128-token blocks: the default config, and FlashAttention-4 (paged) when flash_attn.cute imports,
with the device's time a call alone and the host's for both (what a step that waits on the host
pays).
(bench/kernels.py --sweep times a smaller grid on its fixed cases.)

    PYTHONPATH=.:bench python3 bench/tune_prefill.py tune_prefill.json [--no-grid]

(--no-grid: the default config, the 128-token blocks and FA4 only, also on steps of workload A's
prompts of 2,048, 4,096 and 8,192 tokens: where FA4 starts to pay, triton_fa4's
FA4_MIN_PREFILL_ROWS.)
"""

import json
import random
import sys
import time
from collections.abc import Callable

import torch

import run_info
from kernels import (BLOCK, MODELS, bench_ms, fa4_call, load_fa4, paged_problem, prefill_args,
                     prefill_flops)

from dataplane.kernels.paged_prefill_attention import paged_prefill_attention

NUM_TOKENS = 16384
GRID = [dict(rows=m, BLOCK_N=n, num_warps=w, num_stages=s)
        for m in (64, 128) for n in (32, 64) for w in (4, 8) for s in (2, 3, 4)]


def prompt_lens(num_tokens: int = NUM_TOKENS, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lens = []
    while sum(lens) < num_tokens:
        lens.append(min(rng.randint(100, 1024), num_tokens - sum(lens)))
    return lens


def host_us(run: Callable[[], object], calls: int = 20) -> float:
    """The host's microseconds a call: calls enqueued back to back, timed before the device
    catches up (a long step's kernels outlast their launches)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def device_ms(run: Callable[[], object], calls: int = 20) -> float:
    """The device's milliseconds a call alone: the calls are enqueued while the device sleeps
    (~25 ms), so none waits for the host (do_bench's figure is the host's where a call takes
    the host longer than the device: FA4's ~0.2 ms at small steps)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def time_call(make_run: Callable[[], Callable[[], object]]) -> dict:
    """ms a call (do_bench), the device's ms alone and the host's us a call of what make_run
    returns, or the error that stopped it."""
    try:
        run = make_run()
        run()
        return dict(ms=bench_ms(run, rep=30), device_ms=device_ms(run), host_us=host_us(run))
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record, go on
        return dict(error=f"{type(e).__name__}: {e}"[:300])


def time_config(args: tuple, max_query_len: int, config: dict | None) -> dict:
    return time_call(lambda: lambda: paged_prefill_attention(*args, max_query_len=max_query_len,
                                                             config=config))


def tune(model: str, shape: str, lens: list[int], cached: list[int], fa4: Callable | None,
         grid: list[dict]) -> dict:
    num_heads = MODELS[model]
    group = num_heads // 8
    p = paged_problem(lens, cached, num_heads, BLOCK)
    args, max_query_len = prefill_args(p), p["max_query_len"]
    flops = prefill_flops(lens, cached, num_heads)
    p128 = paged_problem(lens, cached, num_heads, 128)
    beside = dict(block_128=time_config(prefill_args(p128), max_query_len, None))
    if fa4 is not None:
        for block_size in (128, BLOCK):
            beside[f"fa4_block_{block_size}"] = time_call(
                lambda: fa4_call(fa4, lens, cached, num_heads, block_size))
    for row in beside.values():
        if isinstance(row.get("ms"), float):
            row["tflops"] = flops / row["ms"] / 1e9
    print(model, shape, beside, flush=True)
    rows = [dict(config=None, **time_config(args, max_query_len, None))]
    for c in grid:
        config = dict(BLOCK_Q=c["rows"] // group, BLOCK_N=c["BLOCK_N"], num_warps=c["num_warps"],
                      num_stages=c["num_stages"])
        rows.append(dict(config=config, **time_config(args, max_query_len, config)))
    for row in rows:
        if "ms" in row:
            row["tflops"] = flops / row["ms"] / 1e9
        print(model, shape, row, flush=True)
    timed = [r for r in rows if "ms" in r]
    return dict(model=model, shape=shape, default=rows[0], best=min(timed, key=lambda r: r["ms"]),
                rows=rows, **beside)


def main() -> None:
    started = time.perf_counter()
    lens = prompt_lens()
    cases = {"workload A": (lens, [0] * len(lens)), "2 x 8192": ([8192] * 2, [0, 0]),
             "8 x 2048 after 4096": ([2048] * 8, [4096] * 8)}
    fa4, fa4_status = load_fa4()
    print("FA4", fa4_status, flush=True)
    grid = [] if "--no-grid" in sys.argv[2:] else GRID
    if not grid:
        for num_tokens in (2048, 4096, 8192):
            step = prompt_lens(num_tokens)
            cases[f"workload A {num_tokens}"] = (step, [0] * len(step))
    shapes = [tune(model, shape, *case, fa4, grid) for shape, case in cases.items()
              for model in MODELS]
    result = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  torch=torch.__version__, num_tokens=NUM_TOKENS, prompt_lens=lens, fa4=fa4_status,
                  shapes=shapes, seconds=time.perf_counter() - started)
    for s in shapes:
        print(f"{s['model']}, {s['shape']}: default {s['default'].get('ms')} ms, best {s['best']['ms']:.4f} ms "
              f"({s['best']['tflops']:.0f} TFLOP/s) with {s['best']['config']}")
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
