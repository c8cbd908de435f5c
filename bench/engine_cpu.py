"""The engine's own host time per step, on any machine: workload A's shapes (256 requests,
prompts and outputs uniform in [100, 1024], EOS ignored) through the real Engine, scheduler, KV
manager, step codec and detokenizer, against a data plane that answers every step at once. In
the in-process mode this time adds to the model runner's host time on one thread; in split mode
it is most of the control plane's time besides gRPC.

With --simulated-device the data plane takes each step as long as the H200 took for a step of
its shape (workload A's in-process buckets at 3afb82c), and the run reports how long that device
waited for the engine: before its first step and between steps. With --frontend-link the
requests arrive as split mode's do, in one burst of Generate calls from a gRPC front-end over a
real FrontendLink (the socket's other end is in this process), instead of being added directly.

    python bench/engine_cpu.py [--repeat 3]
    python bench/engine_cpu.py --simulated-device --frontend-link --repeat 3

Every run reports the process's CPU time a step (all its threads, the front-end's reading end
included): with --simulated-device --frontend-link --stream-interval 1 it follows a split
run's control_plane_cpu_ms_per_step on the same host, 0.3-0.9 ms a step above it on the H200
hosts (bench/README.md, twenty-second session).
"""

import argparse
import asyncio
import json
import pathlib
import random
import sys
import time

import numpy as np
import zmq
import zmq.asyncio

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.process import tune_gc  # noqa: E402
from common.wire import pack_i32, unpack_i32  # noqa: E402
from controlplane.dataplane_client import DataPlaneInfo  # noqa: E402
from common.model_info import ModelInfo  # noqa: E402
from common.transport import private_ipc_address  # noqa: E402
from controlplane.api_server import GenerationServicer  # noqa: E402
from controlplane.engine import Engine, EngineConfig  # noqa: E402
from controlplane.frontend_link import FrontendLink  # noqa: E402
from controlplane.request import Request  # noqa: E402
from controlplane.scheduler import SchedulerConfig  # noqa: E402
from controlplane.streams import RequestStream  # noqa: E402
from controlplane.tokenizer import Tokenizer  # noqa: E402
from controlplane.validation import Limits, sampling_params  # noqa: E402
from dataplane.checkpoints import build_tokenizer  # noqa: E402
from protos import frontend_pb2, generation_pb2, link_pb2  # noqa: E402

# The H200's decode steps (ms) by rows at the in-process buckets' upper ends, and its prompt
# steps' time per token (34.5 ms for 16,384 tokens), at 3afb82c.
DECODE_ROWS = [1, 32, 64, 96, 128, 160, 192, 224, 256]
DECODE_MS = [1.5, 1.836, 3.131, 3.988, 4.589, 5.275, 5.685, 5.927, 5.844]
PROMPT_MS_PER_TOKEN = 34.5 / 16384


class InstantDataPlane:
    """Answers each step at once with token 7 for every row that reaches its known tokens."""

    is_attached = True
    last_loss_reason = None

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


class SimulatedDevice(InstantDataPlane):
    """Answers each step once a simulated device, which runs one step at a time, is through it;
    counts its busy time, when it got its first step and how long it waited for the others."""

    def __init__(self) -> None:
        super().__init__()
        self.busy_s = self.idle_s = 0.0
        self.first_step_at: float | None = None
        self.free_at: float | None = None  # when the device ends the work it has

    async def execute(self, step: link_pb2.Step, epoch: int, timeout_s: float) -> link_pb2.StepResult:
        scheduled = np.frombuffer(step.num_scheduled_tokens, dtype=np.int32)
        now = time.perf_counter()
        if self.free_at is None:
            self.first_step_at = self.free_at = now
        self.idle_s += max(0.0, now - self.free_at)
        busy = step_ms(len(scheduled), int(scheduled.sum())) / 1e3
        self.busy_s += busy
        done_at = self.free_at = max(now, self.free_at) + busy
        result = await super().execute(step, epoch, timeout_s)
        await asyncio.sleep(done_at - time.perf_counter())
        return result


def step_ms(num_rows: int, num_tokens: int) -> float:
    """The simulated device's time for a step of `num_rows` requests and `num_tokens` new
    tokens: the decode bucket's for its rows, plus the prompt rate for a step with prompts."""
    if num_rows == 0:
        return 0.0
    decode = float(np.interp(num_rows, DECODE_ROWS, DECODE_MS))
    return decode + (PROMPT_MS_PER_TOKEN * num_tokens if num_tokens > num_rows else 0.0)


def workload(num_requests: int) -> list[tuple[list[int], generation_pb2.SamplingParams]]:
    """Workload A's shapes: (prompt ids, sampling) per request, seed 0."""
    rng = random.Random(0)
    return [([rng.randint(1, 300) for _ in range(rng.randint(100, 1024))],
             generation_pb2.SamplingParams(max_tokens=rng.randint(100, 1024), temperature=0.6,
                                           ignore_eos=True))
            for _ in range(num_requests)]


async def run_once(num_requests: int, stream_interval: int, simulated: bool,
                   through_frontend: bool) -> dict:
    tokenizer = Tokenizer(build_tokenizer(320), 320)
    dataplane = SimulatedDevice() if simulated else InstantDataPlane()
    engine = Engine(EngineConfig(SchedulerConfig(256, 16384, 4096), stream_interval=stream_interval),
                    tokenizer, dataplane)
    task = asyncio.create_task(engine.run())
    while not engine.accepting:
        await asyncio.sleep(0)
    requests = workload(num_requests)
    if through_frontend:  # (the client's work, outside the timed run)
        calls = [frontend_pb2.ToEngine(call=frontend_pb2.Call(
            call_id=i, method="Generate", request=generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=prompt), sampling=params
            ).SerializeToString())).SerializeToString() for i, (prompt, params) in enumerate(requests)]
    else:  # added before the timed run, as before --frontend-link existed
        streams = added(engine, requests)
    start, cpu, steps = time.perf_counter(), time.process_time(), engine.num_steps
    if through_frontend:
        await through_frontend_link(engine, calls)
    else:
        await drained(streams)
    seconds, steps = time.perf_counter() - start, engine.num_steps - steps
    cpu = time.process_time() - cpu
    engine.close()
    await task
    result = {"num_steps": steps, "seconds": seconds, "cpu_ms_per_step": 1e3 * cpu / steps}
    if simulated:
        result |= {"device_busy_s": dataplane.busy_s, "device_idle_s": dataplane.idle_s,
                   "first_step_ms": 1e3 * (dataplane.first_step_at - start)}
    return result


def added(engine: Engine, requests: list[tuple[list[int], generation_pb2.SamplingParams]]
          ) -> list[RequestStream]:
    """Every request added to the engine at once, as the offline LLM does."""
    limits = Limits(4096, 320, 4096, 20)
    return [engine.add_request(Request(str(i), prompt, sampling_params(params, len(prompt),
                                                                       limits), ()))
            for i, (prompt, params) in enumerate(requests)]


async def drained(streams: list[RequestStream]) -> None:
    async def drain(stream):
        async for _ in stream:
            pass
    await asyncio.gather(*(drain(s) for s in streams))


async def through_frontend_link(engine: Engine, calls: list[bytes]) -> None:
    """The requests as one burst of Generate calls (serialized ToEngine messages) from a
    front-end, through a FrontendLink, until every call's last reply came back."""
    model = ModelInfo("bench", "none", "Qwen3ForCausalLM", 320, 4096, (), "bfloat16")
    link = FrontendLink(private_ipc_address("frontend"),
                        GenerationServicer(engine, model, 4096, 4096, 20), serving=lambda: True)
    await link.start()
    frontend = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    frontend.connect(link.address)
    for call in calls:
        await frontend.send(call)
    num_open = len(calls)
    while num_open:
        message = frontend_pb2.ToFrontend.FromString(await frontend.recv())
        num_open -= sum(reply.done for reply in message.replies)
    frontend.close(linger=0)
    await link.close()


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
    parser.add_argument("--simulated-device", action="store_true",
                        help="steps take the H200's time for their shape; report its waits")
    parser.add_argument("--frontend-link", action="store_true",
                        help="requests arrive as one burst of calls through a FrontendLink")
    args = parser.parse_args()
    if not args.default_gc:
        tune_gc()
    runs = [asyncio.run(run_once(args.num_requests, args.stream_interval, args.simulated_device,
                                 args.frontend_link))
            for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["seconds"])
    result = {"num_requests": args.num_requests, "stream_interval": args.stream_interval,
              "tuned_gc": not args.default_gc, "simulated_device": args.simulated_device,
              "frontend_link": args.frontend_link,
              "best": {k: round(v, 4) for k, v in best.items()},
              "runs": [{k: round(v, 3) for k, v in r.items()} for r in runs]}
    if not args.simulated_device:  # (the simulated steps' own time would be in it)
        result["engine_ms_per_step"] = round(1e3 * best["seconds"] / best["num_steps"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
