"""The engine's own host time per step, on any machine: workload A's shapes (256 requests,
prompts and outputs uniform in [100, 1024], EOS ignored) through the real Engine, scheduler, KV
manager, step codec and detokenizer, against a data plane that answers every step at once. In
the in-process mode this time adds to the model runner's host time on one thread; in split mode
it is most of the control plane's time besides gRPC.

    python bench/engine_cpu.py [--repeat 3]
"""

import argparse
import asyncio
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.process import tune_gc  # noqa: E402
from common.wire import pack_i32, unpack_i32  # noqa: E402
from controlplane.dataplane_client import DataPlaneInfo  # noqa: E402
from controlplane.engine import Engine, EngineConfig  # noqa: E402
from controlplane.request import Request  # noqa: E402
from controlplane.scheduler import SchedulerConfig  # noqa: E402
from controlplane.tokenizer import Tokenizer  # noqa: E402
from controlplane.validation import Limits, sampling_params  # noqa: E402
from dataplane.checkpoints import build_tokenizer  # noqa: E402
from protos import generation_pb2, link_pb2  # noqa: E402


class InstantDataPlane:
    """Answers each step at once with token 7 for every row that reaches its known tokens."""

    is_attached = True

    def __init__(self) -> None:
        self.num_tokens: dict[int, int] = {}

    async def attach(self) -> DataPlaneInfo:
        return DataPlaneInfo(1, "instant", 1 << 20, 16, 1, "bfloat16", "cuda", "none")

    async def execute(self, step: link_pb2.Step, epoch: int, timeout_s: float) -> link_pb2.StepResult:
        for slot in unpack_i32(step.freed_slots):
            self.num_tokens.pop(slot, None)
        for new in step.new_requests:
            self.num_tokens[new.slot] = len(new.token_ids) // 4
        sampled = []
        for slot, start, n in zip(unpack_i32(step.slots), unpack_i32(step.num_computed_tokens),
                                  unpack_i32(step.num_scheduled_tokens)):
            if start + n == self.num_tokens[slot]:
                self.num_tokens[slot] += 1
                sampled.append(7)
        return link_pb2.StepResult(step_id=step.step_id, sampled_token_ids=pack_i32(sampled))

    def drop(self, reason: str) -> None:
        raise RuntimeError(reason)


async def run_once(num_requests: int, stream_interval: int) -> tuple[int, float]:
    tokenizer = Tokenizer(build_tokenizer(320), 320)
    engine = Engine(EngineConfig(SchedulerConfig(256, 16384, 4096), stream_interval=stream_interval),
                    tokenizer, InstantDataPlane())
    task = asyncio.create_task(engine.run())
    while not engine.accepting:
        await asyncio.sleep(0)
    rng = random.Random(0)
    limits = Limits(4096, 320, 4096, 20)
    streams = []
    for i in range(num_requests):
        prompt = [rng.randint(1, 300) for _ in range(rng.randint(100, 1024))]
        params = generation_pb2.SamplingParams(max_tokens=rng.randint(100, 1024),
                                               temperature=0.6, ignore_eos=True)
        streams.append(engine.add_request(Request(str(i), prompt, sampling_params(
            params, len(prompt), limits), ())))

    async def drain(stream):
        async for _ in stream:
            pass
    start, steps = time.perf_counter(), engine.num_steps
    await asyncio.gather(*(drain(s) for s in streams))
    seconds, steps = time.perf_counter() - start, engine.num_steps - steps
    engine.close()
    await task
    return steps, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--stream-interval", type=int, default=4096,
                        help="4096: read at the end, as the offline LLM does (default); 1: "
                             "a reader per token, as gRPC streams")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--default-gc", action="store_true",
                        help="keep Python's collector settings (the servers tune them)")
    args = parser.parse_args()
    if not args.default_gc:
        tune_gc()
    runs = [asyncio.run(run_once(args.num_requests, args.stream_interval))
            for _ in range(args.repeat)]
    steps, seconds = min(runs, key=lambda r: r[1])
    print(json.dumps({"num_requests": args.num_requests, "stream_interval": args.stream_interval,
                      "tuned_gc": not args.default_gc,
                      "num_steps": steps, "best_seconds": round(seconds, 3),
                      "engine_ms_per_step": round(1e3 * seconds / steps, 3)}))


if __name__ == "__main__":
    main()
