"""Does decode attention read faster when each kv head's keys are contiguous within a block
([blocks, kv_heads, block_size, head_dim]) than in the cache's layout ([blocks, block_size,
kv_heads, head_dim]: 256-byte pieces 2 KB apart)? The launcher takes the cache's strides, so a
head-major copy viewed as [blocks, block_size, kv_heads, head_dim] runs through it unchanged.
Answered on the H200 (bench/results/h200/layout_probe-c0fca10.json, run with the per-key-slot
plan of that tree, which addressed the copy through scaled block ids instead): 0-2% faster, not
worth a layout change.

    PYTHONPATH=.:bench python3 bench/layout_probe.py layout_probe.json
"""

import json
import sys

import torch

from kernels import BLOCK, HEAD_DIM, bench_ms, copy_bandwidth, kv_bytes
from tune_decode import SHAPES, problem

from dataplane.kernels.paged_decode_attention import paged_decode_attention, plan_decode


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored [blocks, kv_heads, block_size, head_dim], viewed in the cache's
    index order."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def main() -> None:
    copy_bw = copy_bandwidth()
    rows_out = []
    for model, rows, lo, hi in SHAPES:
        if model != "qwen3-0.6b":
            continue
        (q, k, v, tables, lens, scale), contexts = problem(model, rows, lo, hi)
        moved = kv_bytes(contexts)
        kh, vh = head_major(k), head_major(v)
        plan = plan_decode(q, k, tables, lens)
        out_a, out_b = torch.empty_like(q), torch.empty_like(q)
        run_a = lambda: paged_decode_attention(q, k, v, tables, lens, scale,  # noqa: E731
                                               out=out_a, plan=plan)
        run_b = lambda: paged_decode_attention(q, kh, vh, tables, lens, scale,  # noqa: E731
                                               out=out_b, plan=plan)
        run_a(), run_b()
        same = torch.equal(out_a, out_b)
        ms_a, ms_b = bench_ms(run_a, rep=60), bench_ms(run_b, rep=60)
        row = dict(rows=rows, contexts=[lo, hi], same_output=same, token_major_us=ms_a * 1e3,
                   head_major_us=ms_b * 1e3,
                   token_major_fraction=moved / (ms_a * 1e-3) / copy_bw,
                   head_major_fraction=moved / (ms_b * 1e-3) / copy_bw)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), block_size=BLOCK,
                       head_dim=HEAD_DIM, copy_bandwidth_gbps=copy_bw / 1e9, rows=rows_out), f,
                  indent=1)


if __name__ == "__main__":
    main()
