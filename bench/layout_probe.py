"""Does decode attention read faster when each kv head's keys are contiguous within a block
([blocks, kv_heads, block_size, head_dim]) than in the cache's layout ([blocks, block_size,
kv_heads, head_dim]: 256-byte pieces 2 KB apart)? The same kernel reads both: block ids scaled
by num_kv_heads and strides (token: head_dim, head: block_size * head_dim) address the head-major
copy, so this launches the kernel below its launcher (whose stride check is for the real cache).
Answered on the H200 (bench/results/h200/layout_probe-c0fca10.json): 0-2% faster, not worth a
layout change.

    PYTHONPATH=.:bench python3 bench/layout_probe.py layout_probe.json
"""

import json
import sys

import torch
import triton

from kernels import BLOCK, HEAD_DIM, NUM_KV_HEADS, bench_ms, copy_bandwidth, kv_bytes
from tune_decode import SHAPES, problem

from dataplane.kernels import paged_decode_attention as pda


def launch(q, k, v, plan, out, stride_tok, stride_head):
    num_reqs, num_heads, head_dim = q.shape
    group = num_heads // NUM_KV_HEADS
    args = (q, k, v, out, plan.tile_req, plan.tile_info, plan.tile_slots, plan.req_tile_start,
            plan.counters, plan.part_out, plan.part_lse, head_dim ** -0.5 * pda.LOG2E, num_reqs,
            q.stride(0), q.stride(1), stride_tok, stride_head, out.stride(0), out.stride(1))
    constexprs = dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
                      HEAD_DIM=head_dim, **pda._config(q.dtype, head_dim))
    num_programs = pda._programs_per_head(q.device, NUM_KV_HEADS, plan.max_programs, args,
                                          constexprs)
    pda._decode_kernel[(NUM_KV_HEADS, num_programs)](*args, **constexprs)
    return out


def main() -> None:
    copy_bw = copy_bandwidth()
    rows_out = []
    for model, rows, lo, hi in SHAPES:
        if model != "qwen3-0.6b":
            continue
        (q, k, v, tables, lens, scale), contexts = problem(model, rows, lo, hi)
        moved = kv_bytes(contexts)
        out_a, out_b = torch.empty_like(q), torch.empty_like(q)
        plan_a = pda.plan_decode(q, k, tables, lens)
        kh = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # head-major storage
        vh = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        plan_b = pda.plan_decode(q, kh, tables * NUM_KV_HEADS, lens)
        run_a = lambda: launch(q, k, v, plan_a, out_a, k.stride(1), k.stride(2))  # noqa: E731
        run_b = lambda: launch(q, kh, vh, plan_b, out_b, kh.stride(1), kh.stride(2))  # noqa: E731
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
