"""The serving benchmark (DESIGN.md), in the shape of `vllm bench serve`: requests of random token
ids arrive over gRPC as a Poisson process at fixed rates (`inf`: all at once), each streamed;
for each rate it reports request and output throughput, TTFT, TPOT, ITL and end-to-end latency
(mean, p50, p90, p99, in ms) and goodput (requests/s that met every SLO given in --goodput).

TTFT: from sending the request to the first streamed token. ITL: between consecutive stream
messages (a message may carry several tokens when the server falls behind or --stream-interval
is above 1; tokens_per_message says how many). TPOT: per request, (end-to-end - TTFT) over the
tokens after the first.

    python bench/serving.py                                   # CPU, serve's small default model
    python bench/serving.py --frontends 0                     # gRPC in the engine's process
    python bench/serving.py --model qwen3-0.6b --device cuda --request-rates 8 32 128 inf \\
        --input-len 512 --output-len 256 --num-requests 512   # random weights at real shapes
    python bench/serving.py --address HOST:PORT ...           # a server already running
"""

import argparse
import asyncio
import json
import os
import pathlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import run_info  # noqa: E402
from served import serve, step_times  # noqa: E402
from splitserve.client import AsyncClient  # noqa: E402

SHAPES = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Timing:
    """One request, in seconds since it was sent."""
    message_times: list[float] = field(default_factory=list)
    tokens_per_message: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_message)

    def metrics(self) -> dict[str, float | list[float] | None]:
        ttft, e2el = self.message_times[0], self.message_times[-1]
        return {"ttft": ttft, "e2el": e2el,
                "tpot": (e2el - ttft) / (self.num_tokens - 1) if self.num_tokens > 1 else None,
                "itl": list(np.diff(self.message_times))}


def workload(args, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, output length) per request: lengths uniform in len * [1 - ratio, 1 + ratio].
    Each run draws its own (seed): a prompt sent twice would hit the prefix cache."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return rng.randint(max(1, round(mean * (1 - args.range_ratio))),
                           max(1, round(mean * (1 + args.range_ratio))))
    return [([rng.randrange(vocab_size) for _ in range(length(args.input_len))],
             length(args.output_len)) for _ in range(args.num_requests)]


async def one_request(client: AsyncClient, prompt: list[int], max_tokens: int,
                      temperature: float) -> Timing:
    timing = Timing()
    start = time.perf_counter()
    try:
        async for message in client.generate_stream(prompt, max_tokens=max_tokens,
                                                    temperature=temperature, ignore_eos=True):
            if message.token_ids:
                timing.message_times.append(time.perf_counter() - start)
                timing.tokens_per_message.append(len(message.token_ids))
    except Exception as error:  # a failed request is counted and reported, not fatal
        timing.error = f"{type(error).__name__}: {error}"
    return timing


async def run_rate(address: str, requests, rate: float, temperature: float, seed: int
                   ) -> tuple[list[Timing], float]:
    """Sends the requests with exponential gaps of mean 1/rate (none for inf); returns each
    request's timing and the seconds from the first send to the last reply."""
    rng = np.random.default_rng(seed)
    async with AsyncClient(address) as client:
        await client.channel.channel_ready()  # (the connect is not the first request's TTFT)
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(one_request(client, prompt, max_tokens, temperature)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        timings = await asyncio.gather(*tasks)
        return timings, time.perf_counter() - start


def summarize(timings: list[Timing], seconds: float, slos: dict[str, float]) -> dict:
    done = [t for t in timings if not t.error and t.message_times]
    per_request = [t.metrics() for t in done]
    result = {"completed": len(done), "failed": len(timings) - len(done),
              "errors": sorted({t.error for t in timings if t.error})[:5],
              "duration_s": seconds, "request_throughput": len(done) / seconds,
              "output_throughput": sum(t.num_tokens for t in done) / seconds,
              "tokens_per_message": (sum(t.num_tokens for t in done)
                                     / max(1, sum(len(t.message_times) for t in done)))}
    for name in METRICS:
        values = [v for m in per_request
                  for v in (m[name] if name == "itl" else [m[name]]) if v is not None]
        values_ms = 1e3 * np.asarray(values or [np.nan])
        result[f"mean_{name}_ms"] = float(values_ms.mean())
        for p in (50, 90, 99):
            result[f"p{p}_{name}_ms"] = float(np.percentile(values_ms, p))
    if slos:
        good = sum(all(m[k] is not None and 1e3 * m[k] <= limit for k, limit in slos.items())
                   for m in per_request)
        result["goodput"] = good / seconds
    return result


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, limit = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not limit:
            raise SystemExit(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, not {item!r}")
        slos[name] = float(limit)
    return slos


def serve_args(args, workdir: pathlib.Path) -> list[str]:
    out = ["--device", args.device, "--frontends", str(args.frontends),
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting-requests", "65536",
           *args.serve_arg]
    if args.model in SHAPES:  # random weights at these shapes: config only, no checkpoint
        from dataplane import checkpoints
        from throughput import shapes
        model_dir = checkpoints.write_config_only(workdir / args.model, shapes(args.model))
        out += ["--model", str(model_dir), "--load-format", "dummy"]
    elif args.model:
        out += ["--model", args.model]
    return out


def benchmark(address: str, args) -> dict:
    from splitserve.client import Client
    with Client(address) as client:
        info = client.model_info()
        warm = [(p, 8) for p, _ in workload(args, info.vocab_size, args.seed)[:args.num_warmup]]
        asyncio.run(run_rate(address, warm, float("inf"), args.temperature, args.seed))
        slos = parse_slos(args.goodput)
        results = []
        for i, rate in enumerate(args.request_rates, start=1):
            requests = workload(args, info.vocab_size, args.seed + i)
            before = client.load()
            timings, seconds = asyncio.run(run_rate(address, requests, rate, args.temperature,
                                                    args.seed))
            results.append({"request_rate": rate if rate != float("inf") else "inf",
                            **summarize(timings, seconds, slos),
                            **step_times(before, client.load())})
            print_row(results[-1], len(timings), seconds, bool(slos))
    return {"model_name": info.model_name, "tp": info.tp_size, "dtype": info.dtype,
            "results": results}


def print_row(row: dict, num_requests: int, seconds: float, has_slos: bool) -> None:
    ms = lambda value: f"{value:.1f}" if value is not None else "-"  # noqa: E731
    print(f"rate {row['request_rate']:>6}: {row['completed']}/{num_requests} done in "
          f"{seconds:.1f} s, {row['output_throughput']:.0f} tok/s; TTFT p50 "
          f"{row['p50_ttft_ms']:.0f} / p99 {row['p99_ttft_ms']:.0f} ms, TPOT p50 "
          f"{row['p50_tpot_ms']:.1f} ms, ITL p50 {row['p50_itl_ms']:.1f} / p99 "
          f"{row['p99_itl_ms']:.1f} ms" + (f", goodput {row['goodput']:.2f} req/s" if has_slos
                                          else "")
          + f"; data plane ms per prompt step (host / total) {ms(row['prompt_step_host_ms'])} / "
          f"{ms(row['prompt_step_total_ms'])} x {row['num_prompt_steps']}, per decode step "
          f"{ms(row['decode_step_host_ms'])} / {ms(row['decode_step_total_ms'])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="a running server; else `splitserve serve` is started")
    parser.add_argument("--model", default="",
                        help=f"a model directory, or {', '.join(SHAPES)} for random weights at "
                             "those shapes; serve's default model when empty")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frontends", type=int, default=1, help="serve's --frontends")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="one more argument for serve (repeat: --serve-arg=--tp --serve-arg=2)")
    parser.add_argument("--request-rates", type=float, nargs="+", default=[2.0, 8.0, float("inf")],
                        help="requests per second, a run each; inf sends all at once")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-warmup", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="lengths uniform in len * [1 - ratio, 1 + ratio]")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs a request must meet to count: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--out", type=pathlib.Path, help="write the JSON here")
    args = parser.parse_args()
    parse_slos(args.goodput)
    if args.address:
        measured = benchmark(args.address, args)
    else:
        workdir = pathlib.Path(tempfile.mkdtemp())
        with serve(serve_args(args, workdir), workdir / "serve.log") as served:
            measured = benchmark(served.address, args)
    commit = run_info.commit()
    config = vars(args) | {"out": str(args.out), "request_rates": [
        r if r != float("inf") else "inf" for r in args.request_rates]}
    result = {"benchmark": "serving", "device": device_name(args.device), "commit": commit,
              "config": config, **measured}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
