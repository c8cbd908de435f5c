"""Where the data plane's host time goes in steps that carry a prompt (piecewise graphs since the
eighth session, up to 16,384 tokens since the twelfth): cProfile over ModelRunner.submit while
--num-prompts requests of --prompt-len random tokens arrive next to 16 running decodes,
in-process on CUDA.
Prints the mean host milliseconds of a prompt step (profiled, so inflated; serving.py's GetLoad
figures are the unprofiled ones) and of a decode step, and the functions with the most own time
in prompt steps.

    python bench/host_profile.py [--model qwen3-0.6b] [--prompt-len 512]
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import shapes, step_shape  # noqa: E402

from dataplane import checkpoints  # noqa: E402
from splitserve.llm import LLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="16384: workload A's prompt steps")
    parser.add_argument("--num-prompts", type=int, default=48, help="arriving next to 16 decodes")
    args = parser.parse_args()
    model_dir = checkpoints.write_config_only(pathlib.Path(tempfile.mkdtemp()) / args.model,
                                              shapes(args.model))
    llm = LLM(model_dir, device="cuda", load_format="dummy", max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096)
    rng = random.Random(0)
    prompt = lambda: [rng.randint(0, 10000) for _ in range(args.prompt_len)]  # noqa: E731
    llm.generate([prompt() for _ in range(16)], max_tokens=16, ignore_eos=True)  # warm-up
    profiler = cProfile.Profile()
    times = {"prompt": [], "decode": []}
    inner = llm.runner.submit

    def submit(step):
        rows, tokens, _ = step_shape(step)
        has_prompt = tokens > rows
        start = time.perf_counter()
        if has_prompt:
            profiler.enable()
        try:
            return inner(step)
        finally:
            profiler.disable()
            times["prompt" if has_prompt else "decode"].append(time.perf_counter() - start)
    llm.runner.submit = submit
    # 16 long-running requests decode while 48 more arrive (the engine admits them as it goes)
    prompts = [prompt() for _ in range(16 + args.num_prompts)]
    llm.generate(prompts, [{"max_tokens": 200 if i < 16 else 8} for i in range(len(prompts))],
                 temperature=0.6, ignore_eos=True)
    llm.close()
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
