"""Where the data plane's host time goes in steps that carry a prompt (piecewise graphs since the
eighth session, up to 16,384 tokens since the twelfth): cProfile over ModelRunner.submit while
--num-prompts requests of --prompt-len random tokens arrive next to 16 running decodes,
in-process on CUDA.
Prints the mean host milliseconds of a prompt step (profiled, so inflated; serving.py's GetLoad
figures are the unprofiled ones) and of a decode step, and the functions with the most own time
in prompt steps. With --timers, no profiler: the host time of each phase of a step (staging,
graph replays, the attention between the pieces, the LM head, sampling, ...) by clocks around
those calls alone, per step of each kind, and what the step spent outside them.

    python bench/host_profile.py [--model qwen3-0.6b] [--prompt-len 512] [--timers]
    python bench/host_profile.py --max-num-batched-tokens 16384 --prompt-len 562 --num-prompts 96
"""

import argparse
import cProfile
import io
import pathlib
import pstats
import random
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import shapes, step_shape  # noqa: E402

from dataplane import checkpoints, model_runner  # noqa: E402
from dataplane.cuda_graphs import StepBuffers  # noqa: E402
from dataplane.input_batch import InputBatch  # noqa: E402
from dataplane.layers.attention import Attention  # noqa: E402
from splitserve.llm import LLM  # noqa: E402


class PhaseTimers:
    """Clocks around the calls a step's host time is made of (none runs inside another), while
    `kind` is set: the kind of step being submitted."""

    def __init__(self, runner) -> None:
        self.kind: str | None = None
        self.seconds: dict[tuple[str, str], float] = {}
        for name, owner, attribute in [
                ("apply deltas", InputBatch, "apply"), ("stage", InputBatch, "stage"),
                ("prepare (eager tensors)", InputBatch, "prepare"),
                ("graph inputs (prompt)", StepBuffers, "load"),
                ("graph replays", torch.cuda.CUDAGraph, "replay"),
                ("attention between pieces", Attention, "attend"),
                ("LM head", runner.model, "compute_logits"),
                ("sampling batch", InputBatch, "sampling_batch"),
                ("sampler", model_runner, "sample"),
                ("append sampled", InputBatch, "append_sampled"),
                ("tokens to host", runner, "_to_host")]:
            setattr(owner, attribute, self._timed(name, getattr(owner, attribute)))

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            if self.kind is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = (self.kind, name)
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
        return timed

    def report(self, times: dict[str, list[float]]) -> None:
        for kind, seconds in times.items():
            if not seconds:
                continue
            mean = 1e3 * sum(seconds) / len(seconds)
            print(f"{kind} steps: {len(seconds)}, host ms a step (no profiler): mean {mean:.3f}")
            timed = 0.0
            for (k, name), total in sorted(self.seconds.items(), key=lambda x: -x[1]):
                if k == kind:
                    timed += 1e3 * total / len(seconds)
                    print(f"  {name:26s} {1e3 * total / len(seconds):7.3f}")
            print(f"  {'outside the calls above':26s} {mean - timed:7.3f}")

def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="16384: workload A's prompt steps")
    parser.add_argument("--num-prompts", type=int, default=48, help="arriving next to 16 decodes")
    parser.add_argument("--timers", action="store_true",
                        help="each phase's host time by clocks around it, no profiler")
    args = parser.parse_args()
    model_dir = checkpoints.write_config_only(pathlib.Path(tempfile.mkdtemp()) / args.model,
                                              shapes(args.model))
    llm = LLM(model_dir, device="cuda", load_format="dummy", max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096)
    rng = random.Random(0)
    prompt = lambda: [rng.randint(0, 10000) for _ in range(args.prompt_len)]  # noqa: E731
    llm.generate([prompt() for _ in range(16)], max_tokens=16, ignore_eos=True)  # warm-up
    profiler = cProfile.Profile()
    timers = PhaseTimers(llm.runner) if args.timers else None
    times = {"prompt": [], "decode": []}
    inner = llm.runner.submit

    def submit(step):
        rows, tokens, _ = step_shape(step)
        kind = "prompt" if tokens > rows else "decode"
        start = time.perf_counter()
        if timers is not None:
            timers.kind = kind
        elif kind == "prompt":
            profiler.enable()
        try:
            return inner(step)
        finally:
            profiler.disable()
            if timers is not None:
                timers.kind = None
            times[kind].append(time.perf_counter() - start)
    llm.runner.submit = submit
    # 16 long-running requests decode while 48 more arrive (the engine admits them as it goes)
    prompts = [prompt() for _ in range(16 + args.num_prompts)]
    llm.generate(prompts, [{"max_tokens": 200 if i < 16 else 8} for i in range(len(prompts))],
                 temperature=0.6, ignore_eos=True)
    llm.close()
    if timers is not None:
        timers.report(times)
        return
    for kind, seconds in times.items():
        if seconds:
            print(f"{kind} steps: {len(seconds)}, host ms per submit (prompt steps: under "
                  f"cProfile, which inflates them): mean "
                  f"{1e3 * sum(seconds) / len(seconds):.2f}, max {1e3 * max(seconds):.2f}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(35)
    print(out.getvalue()[-9000:])
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue()[-7000:])


if __name__ == "__main__":
    main()
