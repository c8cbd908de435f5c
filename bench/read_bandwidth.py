"""How fast can the device read, against the copy bandwidth the roofline is computed at?

A Triton kernel streams 2 GiB and sums it (reads only, a few bytes written), for several grid
sizes; torch's copy of 1 GiB (reads plus writes, as throughput.py measures it) beside it.

    PYTHONPATH=.:bench python3 bench/read_bandwidth.py read_bandwidth.json
"""

import json
import sys

import torch
import triton
import triton.language as tl

from kernels import bench_ms, copy_bandwidth


@triton.jit
def _read_kernel(x_ptr, out_ptr, num_chunks, CHUNK: tl.constexpr):
    acc = tl.zeros([CHUNK], tl.float32)
    for chunk in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        acc += tl.load(x_ptr + chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_bandwidth(programs: int, chunk: int = 4096) -> float:
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    out = torch.empty(programs, dtype=torch.float32, device="cuda")
    run = lambda: _read_kernel[(programs,)](x, out, x.numel() // chunk, CHUNK=chunk,  # noqa: E731
                                            num_warps=8)
    run()
    return x.numel() * x.element_size() / (bench_ms(run) * 1e-3)


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    reads = {f"{n} programs/SM": read_bandwidth(n * sms) for n in (1, 2, 4, 8, 16)}
    report = dict(device=torch.cuda.get_device_name(), copy_gbps=copy / 1e9,
                  read_gbps={k: v / 1e9 for k, v in reads.items()},
                  best_read_over_copy=max(reads.values()) / copy)
    print(json.dumps(report, indent=1))
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
