"""What the benchmarks that run `splitserve serve` share: starting it, and a run's figures."""

import contextlib
import pathlib
import subprocess
import sys
from collections.abc import Iterator, Sequence

from common.transport import free_tcp_port
from splitserve.client import Client

ROOT = pathlib.Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def serve(serve_args: Sequence[str], log_path: pathlib.Path,
          timeout: float = 600) -> Iterator[str]:
    """`splitserve serve` with these arguments on a free port, its output in log_path; yields
    its address once health says SERVING, and stops it (SIGTERM) on the way out."""
    port = free_tcp_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "splitserve", "serve", "--port", str(port),
                                   *serve_args], cwd=ROOT, stdout=log, stderr=log)
    address = f"127.0.0.1:{port}"
    try:
        with Client(address) as client:
            if not client.wait_until_serving(timeout):
                raise RuntimeError(f"server not serving after {timeout:.0f} s; see {log_path}")
        yield address
    finally:
        server.terminate()
        server.wait(60)


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
    mean host and total milliseconds of a prompt step and of a decode step, and the seconds
    the device sat idle waiting for the host before each kind (in-process runs report the
    same as device_time's device_idle_s)."""
    steps = after.num_steps - before.num_steps
    prompt_steps = after.num_prompt_steps - before.num_prompt_steps
    spent = lambda field: getattr(after, field) - getattr(before, field)  # noqa: E731
    out = {"num_prompt_steps": prompt_steps}
    for kind, count in (("prompt", prompt_steps), ("decode", steps - prompt_steps)):
        for part in ("host", "total"):
            field = f"{kind}_step_{part}_seconds"
            out[f"{kind}_step_{part}_ms"] = 1e3 * spent(field) / count if count else None
        out[f"{kind}_step_device_idle_s"] = spent(f"{kind}_step_device_idle_seconds")
    return out
