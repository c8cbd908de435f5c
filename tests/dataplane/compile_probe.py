"""For test_gpu_runner, in a process of its own whose TRITON_CACHE_DIR starts empty: an LLM on
CUDA attaches (configure and its warm-up), then serves a varied workload (prompt lengths across
block boundaries, chunked prefill mixed with decodes, many decode batch sizes up to 14, greedy
and sampled rows, per-request seeds, top-k/top-p, penalties, logprobs). Prints, as the last line, a
JSON list of the Triton kernels that compiled during the workload.

    python -m tests.dataplane.compile_probe MODEL_DIR [--dtype D] [--attention-backend B]
"""

import argparse
import json
import os
import pathlib
import random

from splitserve.llm import LLM

LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 129, 250, 300]
LONG_BUDGET = 1024
LONG_PROMPT = 700  # over 512 tokens: the prefill kernel's 3-stage (num_stages) variant
# Steps of 2,048 rows (tma_matmul.py's gated prefill tiles): two prompts' chunks filling a step
PROMPT_STEP_BUDGET = 2048
PROMPT_STEP = 1100


def compiled_kernels() -> set[str]:
    """Cache entries (hash directory / kernel name) of every kernel compiled so far."""
    root = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
    return {f"{p.parent.name}/{p.stem}" for p in root.glob("*/*.json")
            if not p.name.startswith("__grp__")}


def sampling(rng: random.Random, i: int) -> dict:
    options = {"max_tokens": rng.randint(1, 40), "temperature": (0.0, 0.6, 1.0)[i % 3]}
    if i % 4 == 1:
        options["seed"] = 1000 + i
    if i % 5 == 2:
        options |= {"top_k": 20, "top_p": 0.9}
    if i % 6 == 3:
        options |= {"repetition_penalty": 1.1, "presence_penalty": 0.5}
    if i % 7 == 4:
        options["logprobs"] = 3
    return options


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    args = parser.parse_args()
    budget = args.max_num_batched_tokens
    llm = LLM(args.model_dir, device="cuda", max_num_seqs=16, max_num_batched_tokens=budget,
              max_model_len=max(512, budget), dtype=args.dtype,
              attention_backend=args.attention_backend)
    try:
        llm.loop.run_until_complete(llm.dataplane.attach())
        before = compiled_kernels()
        rng = random.Random(0)
        vocab = llm.model.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]
        per_prompt = [sampling(rng, i) for i in range(len(prompts))]
        llm.generate(prompts, per_prompt, ignore_eos=True)
        for size in (1, 3):  # small batches from the start
            llm.generate(prompts[-size:], per_prompt[-size:], ignore_eos=True)
        if budget >= LONG_BUDGET:  # one step, the long prompt first (the short ones' cached
            # blocks come from the prefix cache: ~60 of their tokens are computed)
            long = [rng.randrange(vocab) for _ in range(LONG_PROMPT)]
            llm.generate([long, *prompts[:11]], per_prompt[:12], ignore_eos=True)
        if budget >= PROMPT_STEP_BUDGET:
            longs = [[rng.randrange(vocab) for _ in range(PROMPT_STEP)] for _ in range(2)]
            llm.generate(longs, per_prompt[:2], ignore_eos=True)
        after = compiled_kernels()
    finally:
        llm.close()
    print(json.dumps(sorted(after - before)))


if __name__ == "__main__":
    main()
