"""The CUDA sampler (dataplane/kernels/categorical_sample.py) by chunk size and warps, at decode
batch sizes of Qwen3's 151,936-token vocabulary, bf16 logits, temperature 0.6, in CUDA graphs;
against the time to read the logits once at the copy bandwidth.

    python bench/sampler_probe.py OUT.json
"""

import json
import pathlib
import sys

import torch
import triton.testing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import run_info  # noqa: E402
from dataplane.kernels.categorical_sample import categorical_sample  # noqa: E402
from throughput import copy_bandwidth  # noqa: E402

VOCAB = 151936


def main() -> None:
    bandwidth = copy_bandwidth()
    cases = []
    for rows in (1, 8, 32, 128, 256):
        logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
        t = torch.full((rows,), 0.6, device="cuda")
        read_us = 1e6 * logits.numel() * 2 / bandwidth
        for chunk in (2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                run = lambda: categorical_sample(logits, t, 1, chunk=chunk, num_warps=warps)  # noqa: E731,B023
                us = 1e3 * triton.testing.do_bench_cudagraph(run, rep=50)
                cases.append({"rows": rows, "chunk": chunk, "num_warps": warps, "us": us,
                              "read_us": read_us})
                print(f"rows {rows:3d} chunk {chunk:5d} warps {warps:2d}: {us:6.1f} us "
                      f"(reading the logits once: {read_us:.1f} us)", flush=True)
    out = {"device": torch.cuda.get_device_name(), "commit": run_info.commit(),
           "copy_bandwidth_GBps": bandwidth / 1e9, "cases": cases}
    pathlib.Path(sys.argv[1]).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
