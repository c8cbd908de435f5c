"""One TP rank for test_tensor_parallel: runs the steps of tests/dataplane/steps.py over gloo and,
on rank 0, saves the logits. Usage: tp_worker.py MODEL_DIR RANK WORLD INIT_METHOD OUT.pt"""

import sys

import torch

from dataplane.distributed import ParallelConfig, init_distributed, shutdown_distributed
from dataplane.model_runner import ModelRunner, RunnerConfig
from tests.dataplane.steps import Sched, configure, make_step

PROMPTS = [[5, 17, 99, 3, 250, 7, 81], [11, 2], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


def main(model_dir: str, rank: int, world: int, init_method: str, out: str) -> None:
    torch.set_num_threads(1)
    init_distributed(ParallelConfig(rank, world, init_method, "cpu"))
    runner = ModelRunner.load(RunnerConfig(model_dir=model_dir, block_size=4, num_kv_blocks=64))
    runner.configure(configure())
    scheds = [Sched(0, 0, 7, [0, 1], new_tokens=PROMPTS[0]), Sched(1, 0, 2, [2], new_tokens=PROMPTS[1]),
              Sched(2, 0, 6, [3, 4], new_tokens=PROMPTS[2])]  # the third: a first chunk of 6
    prefill, _ = runner.forward(make_step(1, scheds))
    chunk, _ = runner.forward(make_step(2, [Sched(2, 6, 4, [5])]))
    # execute() samples on rank 0 and broadcasts the token to the other ranks
    result = runner.execute(make_step(3, [Sched(1, 0, 2, [6], new_tokens=PROMPTS[1])], freed=[1]))
    if rank == 0:
        torch.save({"prefill": prefill, "chunk": chunk, "sampled": result.sampled_token_ids}, out)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
