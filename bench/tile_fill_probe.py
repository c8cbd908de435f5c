"""Does decode attention pay for the unfilled part of each request's last key tile? The same
batches as tune_decode.py (requests with contexts uniform in a range), then the same contexts
moved to whole 128-key tiles (rounded up) and to one key past whole tiles (the worst fill), each
with 128- and 64-key tiles. If the time follows the tiles rather than the bytes, the fraction of
the copy bandwidth drops with the fill.

    PYTHONPATH=$PWD:$PWD/bench python3 bench/tile_fill_probe.py $OUT/tile_fill.json
"""

import json
import sys

import torch

import run_info
from kernels import BLOCK, HEAD_DIM, MODELS, bench_ms, copy_bandwidth, kv_bytes, paged_problem
from tune_decode import SHAPES, batch_contexts

from dataplane.kernels.paged_decode_attention import paged_decode_attention, plan_decode

FILLS = {"uniform": lambda c: c, "whole_tiles": lambda c: -(-c // 128) * 128,
         "one_past_tiles": lambda c: (c // 128) * 128 + 1}


def measure(model: str, contexts: list[int], block_n: int, copy_bw: float) -> dict:
    p = paged_problem([1] * len(contexts), [c - 1 for c in contexts], MODELS[model], BLOCK)
    args = (p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
            HEAD_DIM ** -0.5)
    plan = plan_decode(*args[:2], *args[3:5], block_n=block_n)
    ms = bench_ms(lambda: paged_decode_attention(*args, plan=plan), rep=40)
    slots = sum(-(-c // block_n) for c in contexts) * block_n
    return dict(block_n=block_n, context_tokens=sum(contexts), key_slots=slots, us=ms * 1e3,
                fraction_of_copy_bw=kv_bytes(contexts) / (ms * 1e-3) / copy_bw)


def main() -> None:
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    report = dict(device=torch.cuda.get_device_name(), commit=run_info.commit(),
                  copy_bandwidth_gbps=copy_bw / 1e9, rows=[])
    for model, rows, lo, hi in SHAPES:
        contexts = batch_contexts(rows, lo, hi)
        for fill, move in FILLS.items():
            for block_n in (128, 64):
                r = measure(model, [move(c) for c in contexts], block_n, copy_bw)
                report["rows"].append(dict(model=model, rows=rows, fill=fill, **r))
                print(f"{model} {rows:3d} rows {fill:15s} BLOCK_N {block_n:3d}: {r['us']:6.1f} us"
                      f" {r['context_tokens']:7d} keys in {r['key_slots']:7d} slots,"
                      f" {100 * r['fraction_of_copy_bw']:.1f}% of copy", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
