"""Where a decode step's time goes, in-process: torch.profiler over 20 decode steps of --rows
requests (256; --prompt-len 512-token prompts, 40 output tokens; the prefill steps before them
are not profiled) after an identical warm-up run; with --phase prefill, over the prompts' steps
instead. Prints the wall and device-kernel time per step, the top device kernels, the top host
ops and the host-side breakdown.

    python bench/profile_decode.py [--model qwen3-0.6b] [--rows 32] [--phase prefill]
                                   [--out trace.json]
"""

import argparse
import pathlib
import random
import sys
import tempfile
import time

import torch
from torch.autograd import DeviceType

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import HostTimes, shapes  # noqa: E402

from dataplane import checkpoints  # noqa: E402
from splitserve.llm import LLM  # noqa: E402

BATCHED_TOKENS = 16384  # a step's token budget: the prefill steps to skip follow from it
STEPS = 20  # decode steps profiled


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, default=256, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                        help="prefill: profile the prompts' steps (all but the first) instead")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    model_dir = checkpoints.write_config_only(pathlib.Path(tempfile.mkdtemp()) / args.model,
                                              shapes(args.model))
    llm = LLM(model_dir, device="cuda", load_format="dummy", max_num_seqs=256,
              max_num_batched_tokens=BATCHED_TOKENS, max_model_len=4096)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.rows)]
    llm.generate(prompts, max_tokens=40, temperature=0.6, ignore_eos=True)
    host = HostTimes(llm)
    prompts = [[rng.randint(0, 10000) for _ in range(args.prompt_len)] for _ in range(args.rows)]
    prefill_steps = -(-args.rows * args.prompt_len // BATCHED_TOKENS)
    if args.phase == "decode":  # the prompts' prefill steps and 4 more go by
        wait, warmup, active = prefill_steps + 4, 2, STEPS
    else:
        wait, warmup, active = 0, 1, prefill_steps - 1
    assert active > 0, "--phase prefill needs prompts that take more than one step"
    schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    marks: list[float] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA],
                                schedule=schedule) as prof:
        inner = llm.runner.submit

        def submit(step):
            pending = inner(step)
            prof.step()
            marks.append(time.perf_counter())
            return pending
        llm.runner.submit = submit
        llm.generate(prompts, max_tokens=40, temperature=0.6, ignore_eos=True)
    wall = marks[wait + warmup + active - 1] - marks[wait + warmup - 1]
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA
                    and not e.key.startswith("ProfilerStep"))  # the step's span, not a kernel
    print(f"{active} {args.phase} steps of {args.rows} rows: {1e3 * wall / active:.2f} ms/step "
          f"wall; device kernels {device_us / 1e3 / active:.2f} ms/step "
          f"({device_us / 1e6 / wall:.0%})")
    print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print("host:", host.report())
    if args.out:
        prof.export_chrome_trace(str(args.out))
    llm.close()


if __name__ == "__main__":
    main()
