"""What the benchmarks that run `splitserve serve` share: starting it, and a run's figures."""

import collections
import contextlib
import itertools
import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from common.transport import free_tcp_port
from splitserve.client import Client

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Served:
    """A running `splitserve serve`: where clients connect, and its process."""

    address: str
    pid: int  # `splitserve serve`'s: its children are the engine, front-ends and data plane


@contextlib.contextmanager
def serve(serve_args: Sequence[str], log_path: pathlib.Path,
          timeout: float = 600) -> Iterator[Served]:
    """`splitserve serve` with these arguments on a free port, its output in log_path; yields
    it once health says SERVING, and stops it (SIGTERM) on the way out."""
    port = free_tcp_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", "--port", str(port),
                                   *serve_args], cwd=ROOT, stdout=log, stderr=log)
    address = f"127.0.0.1:{port}"
    try:
        with Client(address) as client:
            if not client.wait_until_serving(timeout):
                raise RuntimeError(f"server not serving after {timeout:.0f} s; see {log_path}")
        yield Served(address, server.pid)
    finally:
        server.terminate()
        server.wait(60)


@contextlib.contextmanager
def sampled(pid: int, raw_path: pathlib.Path | None) -> Iterator[None]:
    """While the block runs, py-spy (on PATH) samples process `pid` and its children at 500 Hz
    without pausing them, into raw_path (py-spy's raw format: a stack and its count a line;
    its own output beside it, .log); does nothing when raw_path is None. `spy_summary` reads
    the file. Time the work inside the block: py-spy's start and its writing are outside."""
    if raw_path is None:
        yield
        return
    with open(raw_path.with_suffix(".log"), "w") as log:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--subprocesses",
                                "--nonblocking", "--rate", "500", "--format", "raw",
                                "--output", str(raw_path)], stdout=log, stderr=log)
    time.sleep(1.0)  # py-spy attaches to the process tree after it starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        if spy.wait(60) not in (0, -signal.SIGINT):
            print(f"py-spy failed (exit {spy.returncode}); see {raw_path.with_suffix('.log')}",
                  file=sys.stderr)


def spy_summary(raw_path: pathlib.Path, top: int = 25) -> dict:
    """Per sampled process (py-spy names it in each stack's leading frames): its samples, and
    the functions most often on its stacks (inclusive) and at their tops (self), as shares of
    its samples. py-spy leaves out samples of threads it judges idle (waiting in select or on a
    lock); waits that spin (a CUDA event's synchronize) still count."""
    stacks: dict[str, collections.Counter] = {}
    for line in raw_path.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        # a frame is `function (file:line)`: one key per function, not per line
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        # (a child's stacks start with its parents' frames: `process PID:"COMMAND"`)
        processes = list(itertools.takewhile(lambda f: f.startswith("process "), frames))
        frames = frames[len(processes):]
        command = re.search(r"splitserve (\w+)", processes[-1]) if processes else None
        process = command.group(1) if command else (processes or ["?"])[-1][:80]
        counters = stacks.setdefault(process, collections.Counter())
        counters["", "total"] += int(count)
        for frame in set(frames):
            counters[frame, "inclusive"] += int(count)
        if frames:
            counters[frames[-1], "self"] += int(count)
    summary = {}
    for process, counters in sorted(stacks.items(), key=lambda kv: -kv[1]["", "total"]):
        total = counters["", "total"]
        share = lambda kind: {f: round(n / total, 4) for (f, k), n in  # noqa: E731
                              counters.most_common() if k == kind}
        summary[process] = {"samples": total,
                            "inclusive": dict(list(share("inclusive").items())[:top]),
                            "self": dict(list(share("self").items())[:top])}
    return summary


def figures(before, after, done) -> dict:
    """From GetLoad before and after the run and the run's Completions: steps, output tokens,
    stream messages per token, link bytes and control-plane CPU (engine process and gRPC
    front-end) per step. Fails when a token counted in usage never reached the client."""
    steps = after.num_steps - before.num_steps
    tokens = sum(c.completion_tokens for c in done)
    lost = tokens - sum(len(c.token_ids) for c in done)
    assert lost == 0, f"{lost} tokens counted in usage never reached the client"
    per_step = lambda field: (getattr(after, field) - getattr(before, field)) / steps  # noqa: E731
    return {"num_steps": steps, "output_tokens": tokens,
            "stream_messages_per_token": sum(c.num_chunks for c in done) / tokens,
            "bytes_per_step_sent": per_step("link_bytes_sent"),
            "bytes_per_step_received": per_step("link_bytes_received"),
            "control_plane_cpu_ms_per_step": 1e3 * per_step("control_plane_cpu_seconds"),
            "frontend_cpu_ms_per_step": 1e3 * per_step("frontend_cpu_seconds"),
            **step_times(before, after)}


def step_times(before, after) -> dict:
    """From GetLoad before and after: how many steps had prompt tokens, the data plane's own
    mean host and total milliseconds of a prompt step and of a decode step, the seconds the
    device worked on each kind (the in-process run's device_time.device_s_by_kind), and the
    seconds it sat idle before each kind, over steps sent while another was in flight (the
    in-process run's device_time.device_idle_s sums every gap between its steps)."""
    steps = after.num_steps - before.num_steps
    prompt_steps = after.num_prompt_steps - before.num_prompt_steps
    spent = lambda field: getattr(after, field) - getattr(before, field)  # noqa: E731
    out = {"num_prompt_steps": prompt_steps}
    for kind, count in (("prompt", prompt_steps), ("decode", steps - prompt_steps)):
        for part in ("host", "total"):
            field = f"{kind}_step_{part}_seconds"
            out[f"{kind}_step_{part}_ms"] = 1e3 * spent(field) / count if count else None
        out[f"{kind}_step_device_s"] = spent(f"{kind}_step_device_seconds")
        out[f"{kind}_step_device_idle_s"] = spent(f"{kind}_step_device_idle_seconds")
    return out
