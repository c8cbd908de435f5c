"""Workload A (DESIGN.md): 256 requests, prompts of uniform [100, 1024] random token ids,
outputs of uniform [100, 1024] tokens, temperature 0.6, EOS ignored, seed 0, on random weights
at real shapes, in two modes:

  inprocess  the engine and the model runner in this process (splitserve.llm.LLM)
  split      `splitserve serve` as processes, every request sent at once through gRPC (timed
             from the first call on a connected channel to the last token, as in-process is
             timed around generate(); until the forty-first session the client's connect and
             its event loop's start and end, 2-5 ms on the CPU machine, were in the time)

It measures the device's copy bandwidth in the same run and the workload's bandwidth roofline
(bytes every decode step must read: the weights once plus every cached token's K and V), and
writes one JSON per mode to --out-dir with output tokens/s, the fraction of the roofline, the
split/in-process ratio, bytes per step over ZeroMQ and the CPU time per step of the control
plane's engine process and of its gRPC front-end;
in-process also the host time per runner/engine call and the device's busy and idle time per
step by batch size.

    python bench/throughput.py --model qwen3-0.6b --modes inprocess split --out-dir bench/results
"""

import argparse
import asyncio
import gc
import json
import pathlib
import random
import re
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlplane.engine import EngineConfig  # noqa: E402
from dataplane import checkpoints  # noqa: E402
from dataplane.models import model_class  # noqa: E402
import run_info  # noqa: E402
from served import figures, sampled, serve, spy_summary  # noqa: E402


def shapes(name: str):
    if name == "qwen3-0.6b":
        return checkpoints.hf_config(checkpoints.QWEN3_0_6B)
    if name == "qwen3-8b":
        return checkpoints.hf_config(checkpoints.QWEN3_8B)
    if name == "qwen3-30b-a3b":
        return checkpoints.hf_moe_config(checkpoints.QWEN3_30B_A3B)
    raise SystemExit(f"unknown model {name}")


def workload(num_requests: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_requests)]
    return prompts, [rng.randint(100, 1024) for _ in range(num_requests)]


def weight_bytes(config, dtype_bytes: int = 2) -> int:
    """Every parameter once (a tied embedding once: the LM head reads it whole; the embedding
    lookup reads only the step's rows). MoE: every expert, as a large batch touches them all."""
    with torch.device("meta"):
        model = model_class(config)(config)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def roofline(config, prompts, outputs, bandwidth: float, max_num_seqs: int,
             num_devices: int = 1) -> dict:
    """The ideal schedule: all requests decode together (they fit max_num_seqs); decode step i
    reads the weights once and the K/V of every cached token of every request still going.
    Tensor parallelism shards both over num_devices devices, each with `bandwidth`."""
    assert len(prompts) <= max_num_seqs
    weights, per_token = weight_bytes(config), kv_bytes_per_token(config)
    lengths = [(len(p), o) for p, o in zip(prompts, outputs)]
    total = 0
    for i in range(max(outputs)):
        cached = sum(p + i for p, o in lengths if o > i)
        total += weights + cached * per_token
    seconds = total / (bandwidth * num_devices)
    return {"roofline_seconds": seconds, "roofline_tok_per_s": sum(outputs) / seconds,
            "bytes_read": total, "weight_bytes": weights, "kv_bytes_per_token": per_token,
            "num_devices": num_devices}


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, reads plus writes, median of 10."""
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").uniform_()
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / sorted(times[2:])[len(times[2:]) // 2]


class HostPauses:
    """The suspects for a host stall that shows as a device gap, over the timed run: the
    garbage collector's pauses by generation (count, total and longest ms) and the CUDA caching
    allocator's trips to the driver (cudaMalloc, cudaFree, retries after freeing its cache)."""

    _ALLOCATOR = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {}
        self._start = 0.0
        self._memory = torch.cuda.memory_stats()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.setdefault(info["generation"], []).append(time.perf_counter() - self._start)

    def report(self) -> dict:
        gc.callbacks.remove(self._on_gc)
        memory = torch.cuda.memory_stats()
        return {"gc": {f"gen{g}": {"count": len(v), "total_ms": 1e3 * sum(v), "max_ms": 1e3 * max(v)}
                       for g, v in sorted(self.pauses.items())},
                "allocator": {k: memory.get(k, 0) - self._memory.get(k, 0) for k in self._ALLOCATOR}}


class HostTimes:
    """Where the host's time goes in the in-process run: wraps the runner and the engine."""

    def __init__(self, llm) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        runner, engine = llm.runner, llm.engine
        self._wrap(runner, "submit")
        self._wrap(runner, "finish")
        self._wrap(runner.batch, "stage")
        self._wrap(runner.batch, "prepare")
        self._wrap(runner.batch, "sampling_batch")
        self._wrap(engine, "_process")
        self._wrap(engine, "_launch")
        if runner.graphs is not None:
            self._wrap(runner.graphs, "run")

    def _wrap(self, obj, name: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.counts[name] = self.counts.get(name, 0) + 1
        setattr(obj, name, timed)

    def report(self) -> dict:
        return {name: {"seconds": round(self.seconds[name], 3), "calls": self.counts[name]}
                for name in self.seconds}


def step_shape(step) -> tuple[int, int, int]:
    """A Step message's (requests, new tokens, cached + new tokens). More tokens than requests:
    a step with prompt tokens, run eagerly (the engine's StepTimes uses the same rule)."""
    scheduled = np.frombuffer(step.num_scheduled_tokens, dtype=np.int32)
    computed = np.frombuffer(step.num_computed_tokens, dtype=np.int32)
    tokens = int(scheduled.sum())
    return len(scheduled), tokens, int(computed.sum()) + tokens


class DeviceTimeline:
    """When the device works and when it waits, in the in-process run: a timing event before
    and after each step's device work (it fires when the device gets there), so a step's device
    time excludes the queue ahead of it, and the time from one step's end to the next one's
    start is the device waiting for the host. Read once, after the run (the steps' sizes too:
    the timed loop only records the events)."""

    def __init__(self, llm) -> None:
        self.steps: list[tuple] = []  # (start event, end event, the Step message)
        self.submit_times: list[float] = []  # perf_counter at each step's submit
        runner = llm.runner
        inner = runner.submit

        def submit(step):
            self.submit_times.append(time.perf_counter())
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            pending = inner(step)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.steps.append((start, end, step))
            return pending
        runner.submit = submit

    def report(self, run_start: float, run_seconds: float) -> dict:
        """Device busy and idle seconds over the run, and per decode-batch bucket the mean
        device time and the mean gap before a step; the host's time before the first step
        (the requests built and scheduled) and the rest of the run outside the steps' span
        (the last result read back, the completions gathered)."""
        torch.cuda.synchronize()
        span = self.steps[0][0].elapsed_time(self.steps[-1][1]) / 1e3
        before = self.submit_times[0] - run_start
        busy = [s[0].elapsed_time(s[1]) / 1e3 for s in self.steps]
        gaps = [0.0] + [a[1].elapsed_time(b[0]) / 1e3 for a, b in zip(self.steps, self.steps[1:])]
        buckets: dict[str, list] = {}
        by_kind = {"prompt": 0.0, "decode": 0.0}  # split mode's {kind}_step_device_s
        shapes = [step_shape(step) for _, _, step in self.steps]
        for (rows, tokens, context), b, g in zip(shapes, busy, gaps):
            is_prompt = tokens > rows
            by_kind["prompt" if is_prompt else "decode"] += b
            bucket = "mixed" if is_prompt else f"decode {min(256, -(-rows // 32) * 32)}"
            buckets.setdefault(bucket, []).append((b, g, context))
        submits = np.diff(np.array(self.submit_times), prepend=self.submit_times[0])
        longest = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:5]
        return {"device_busy_s": sum(busy), "device_s_by_kind": by_kind,
                "device_idle_s": sum(gaps),
                "host_before_first_step_s": before,
                "after_last_step_s": run_seconds - before - span,
                # where the device waited longest: the step, its shape, and the host's time
                # from the previous step's submit to this one's
                "longest_gaps": [{"step": i, "gap_ms": 1e3 * gaps[i], "rows": shapes[i][0],
                                  "tokens": shapes[i][1], "host_ms_since_last_submit":
                                  1e3 * float(submits[i])} for i in longest],
                "buckets": {k: {"steps": len(v), "busy_ms": 1e3 * sum(x[0] for x in v) / len(v),
                                "gap_ms": 1e3 * sum(x[1] for x in v) / len(v),
                                "context_tokens": sum(x[2] for x in v) // len(v)}
                            for k, v in sorted(buckets.items())}}


def warm_up(prompts: list[list[int]]) -> tuple[list[list[int]], list[dict]]:
    """A small run with the workload's prompt shapes, before timing in both modes: kernels
    compile for the shapes they will see (prefill chunks mixed with decodes, every batch
    bucket) outside the timed region."""
    head = prompts[:64]
    return head, [{"max_tokens": 24, "temperature": 0.6}] * len(head)


def run_inprocess(model_dir, prompts, outputs, args) -> dict:
    from splitserve.llm import LLM
    llm = LLM(model_dir, device="cuda", load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, prompt_graphs=not args.no_prompt_graphs,
              pdl=not args.no_pdl, pipeline_depth=args.pipeline_depth,
              attention_backend=args.attention_backend, block_size=args.block_size,
              gpu_memory_utilization=args.gpu_memory_utilization)
    llm.generate(*warm_up(prompts), ignore_eos=True)
    host = HostTimes(llm)
    timeline = DeviceTimeline(llm)
    pauses = HostPauses()
    steps_before = llm.engine.num_steps
    cpu_before = time.process_time()
    start = time.perf_counter()
    done = llm.generate(prompts, [{"max_tokens": o} for o in outputs], temperature=0.6,
                        ignore_eos=True)
    seconds = time.perf_counter() - start
    steps = llm.engine.num_steps - steps_before
    info = llm.dataplane.info
    device = timeline.report(start, seconds)
    stalls = pauses.report()
    llm.close()
    print("host time:", json.dumps(host.report()), flush=True)
    print("device time:", json.dumps(device), flush=True)
    print("host pauses:", json.dumps(stalls), flush=True)
    return {"seconds": seconds, "output_tokens": sum(c.completion_tokens for c in done),
            "num_steps": steps, "process_cpu_ms_per_step": 1e3 * (time.process_time() - cpu_before) / steps,
            "num_kv_blocks": info.num_kv_blocks, "block_size": info.block_size,
            "attention_backend": info.attention_backend,
            "host_time": host.report(), "device_time": device,
            "host_pauses": stalls}


def run_split(model_dir, prompts, outputs, args) -> dict:
    from splitserve.client import AsyncClient, Client
    serve_args = [
        "--model", str(model_dir), "--device", "cuda", "--load-format", "dummy",
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--attention-backend", args.attention_backend, "--tp", str(args.tp),
        *(["--block-size", str(args.block_size)] if args.block_size else []),
        "--max-waiting-requests", "4096", "--step-timeout", "600",
        "--stream-interval", str(args.stream_interval), "--frontends", str(args.frontends),
        "--pipeline-depth", str(args.pipeline_depth),
        *(["--enforce-eager"] if args.enforce_eager else []),
        *(["--no-prompt-graphs"] if args.no_prompt_graphs else []),
        *(["--no-pdl"] if args.no_pdl else [])]
    with serve(serve_args, args.out_dir / f"serve-{args.model}.log") as served:
        address = served.address
        warm_prompts, warm_sampling = warm_up(prompts)

        async def warm():
            async with AsyncClient(address) as c:
                await asyncio.gather(*(c.generate(p, **s, ignore_eos=True)
                                       for p, s in zip(warm_prompts, warm_sampling)))
        asyncio.run(warm())
        with Client(address) as client:
            before = client.load()

        async def send_all():
            # Timed from the first call on a connected channel to the last token, as the
            # in-process mode is timed around generate(): not the client's connect.
            async with AsyncClient(address) as client:
                await client.channel.channel_ready()
                start = time.perf_counter()
                done = await asyncio.gather(*(
                    client.generate(p, max_tokens=o, temperature=0.6, ignore_eos=True)
                    for p, o in zip(prompts, outputs)))
                return done, time.perf_counter() - start
        with sampled(served.pid, args.spy):
            done, seconds = asyncio.run(send_all())
        with Client(address) as client:
            after = client.load()
            info = client.model_info()
    return {"seconds": seconds, **figures(before, after, done), "tp": info.tp_size,
            "num_kv_blocks": after.kv_blocks_total, "block_size": info.block_size,
            "attention_backend": info.attention_backend,
            **({"py_spy": spy_summary(args.spy)} if args.spy else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b",
                        choices=("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"))
    parser.add_argument("--modes", nargs="+", default=["split", "inprocess"],
                        choices=("inprocess", "split"))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block, unless the attention backend needs another "
                             "(default: the backend's preferred, serve's default)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-prompt-graphs", action="store_true",
                        help="steps with prompt tokens eagerly (serve's --no-prompt-graphs)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="kernels without programmatic dependent launch (serve's --no-pdl)")
    parser.add_argument("--tp", type=int, default=1, help="split mode only")
    parser.add_argument("--pipeline-depth", type=int, default=EngineConfig.pipeline_depth,
                        help="both modes: steps in flight at once (serve's --pipeline-depth)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="split mode only: serve's --stream-interval (tokens per message)")
    parser.add_argument("--frontends", type=int, default=1,
                        help="split mode only: serve's --frontends (gRPC front-end processes)")
    parser.add_argument("--spy", type=pathlib.Path, metavar="RAW",
                        help="split mode only: sample the server's processes with py-spy (on "
                             "PATH, not pausing them) during the timed run into RAW; the JSON "
                             "gets their busiest functions (sampling may slow the run)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = shapes(args.model)
    model_dir = checkpoints.write_config_only(pathlib.Path(tempfile.mkdtemp()) / args.model, config)
    prompts, outputs = workload(args.num_requests, args.seed)
    bandwidth = copy_bandwidth()
    commit = run_info.commit()
    results = {}
    for mode in args.modes:
        run = run_inprocess if mode == "inprocess" else run_split
        ideal = roofline(config, prompts, outputs, bandwidth, args.max_num_seqs,
                         args.tp if mode == "split" else 1)  # in-process runs one device
        measured = run(model_dir, prompts, outputs, args)
        tok_per_s = measured["output_tokens"] / measured["seconds"]
        results[mode] = {
            "device": torch.cuda.get_device_name(), "commit": commit, "workload": "A",
            "model": args.model, "mode": mode, **measured, "output_tok_per_s": tok_per_s,
            "roofline_tok_per_s": ideal["roofline_tok_per_s"],
            "fraction_of_roofline": tok_per_s / ideal["roofline_tok_per_s"],
            "copy_bandwidth_GBps": bandwidth / 1e9, "roofline": ideal,
            "config": {k: str(v) if isinstance(v, pathlib.Path) else v
                       for k, v in vars(args).items() if k != "out_dir"}}
        print(f"{args.model} {mode}: {measured['output_tokens']} tokens in {measured['seconds']:.2f}s"
              f" = {tok_per_s:.0f} tok/s, {tok_per_s / ideal['roofline_tok_per_s']:.1%} of the "
              f"roofline ({ideal['roofline_tok_per_s']:.0f} tok/s at {bandwidth / 1e9:.0f} GB/s), "
              f"{measured['num_steps']} steps", flush=True)
        _save(args, mode, results[mode])
    if "inprocess" in results and "split" in results:
        ratio = results["split"]["output_tok_per_s"] / results["inprocess"]["output_tok_per_s"]
        results["split"]["split_over_inprocess"] = ratio
        print(f"split / in-process: {ratio:.3f}")
        _save(args, "split", results["split"])


def _save(args, mode: str, result: dict) -> None:
    suffix = f"-si{args.stream_interval}" if mode == "split" and args.stream_interval != 1 else ""
    suffix += f"-fe{args.frontends}" if mode == "split" and args.frontends != 1 else ""
    suffix += "-spy" if mode == "split" and args.spy else ""
    suffix += "-nopdl" if args.no_pdl else ""
    suffix += f"-pd{args.pipeline_depth}" \
        if args.pipeline_depth != EngineConfig.pipeline_depth else ""
    suffix += f"-{args.attention_backend}" if args.attention_backend != "auto" else ""
    suffix += f"-bs{args.block_size}" if args.block_size else ""
    name = re.sub(r"[^a-z0-9.-]+", "-", f"{args.model}-{mode}-tp{args.tp}{suffix}".lower())
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
