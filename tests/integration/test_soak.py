"""A bounded soak: a steady mix of streams, cancels and deadlines for SPLITSERVE_SOAK_SECONDS
(default 120). After a warm-up, the control plane's and the data plane's memory, file
descriptors and threads stay flat, and nothing is left running or holding KV blocks."""

import asyncio
import os
import random
import statistics
import time

import pytest

from splitserve.client import AsyncClient
from tests.integration import harness

SOAK_S = float(os.environ.get("SPLITSERVE_SOAK_SECONDS", "120"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SOAK_S + 180)]


def usage(pid: int) -> tuple[int, int, int]:
    """(RSS in KiB, open file descriptors, threads) of a process, from /proc."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    return (int(status["VmRSS"].split()[0]), len(os.listdir(f"/proc/{pid}/fd")),
            int(status["Threads"]))


async def traffic(address: str, stop_at: float, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}

    async def one(client: AsyncClient) -> str:
        prompt = [rng.randrange(1, 320) for _ in range(rng.randrange(1, 60))]
        cancel_after = rng.randrange(1, 10) if rng.random() < 0.3 else None
        call = client.generate_stream(prompt, max_tokens=rng.randrange(1, 80), temperature=0.8,
                                      ignore_eos=True, timeout=0.2 if rng.random() < 0.1 else 60,
                                      stop=["ab"] if rng.random() < 0.2 else None)
        return await harness.stream_outcome(call, cancel_after)

    async def worker(client: AsyncClient) -> None:
        while time.monotonic() < stop_at:
            outcome = await one(client)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async with AsyncClient(address) as client:
        await asyncio.gather(*(worker(client) for _ in range(16)))
    return outcomes


def test_soak_keeps_resources_flat(checkpoints, tmp_path):
    server = harness.serve(checkpoints["untied"], tmp_path, "--block-size", "4",
                           "--num-kv-blocks", "1024", "--max-num-seqs", "32")
    control_plane = server.processes[0].popen.pid
    data_plane = harness.descendants(control_plane)[0]
    samples: dict[int, list[tuple[float, tuple[int, int, int]]]] = {control_plane: [], data_plane: []}
    try:
        start = time.monotonic()
        stop_at = start + SOAK_S

        async def main():
            load = asyncio.create_task(traffic(server.address, stop_at, seed=0))
            while not load.done():
                for pid in samples:
                    samples[pid].append((time.monotonic() - start, usage(pid)))
                await asyncio.sleep(2)
            return await load

        outcomes = asyncio.run(main())
        assert server.wait_idle()
        assert server.client.load().num_dataplane_losses == 0
    finally:
        server.stop()
    assert outcomes.get("done", 0) > 100 and outcomes.get("cancelled", 0) > 20, outcomes
    assert set(outcomes) <= {"done", "cancelled", "DEADLINE_EXCEEDED", "CANCELLED"}, outcomes
    for pid, series in samples.items():
        warm = [u for t, u in series if SOAK_S * 0.3 <= t < SOAK_S * 0.5]
        end = [u for t, u in series if t >= SOAK_S * 0.8]
        rss_warm, rss_end = (statistics.median(x[0] for x in s) for s in (warm, end))
        fds_warm, fds_end = max(x[1] for x in warm), max(x[1] for x in end)
        threads_warm, threads_end = max(x[2] for x in warm), max(x[2] for x in end)
        print(f"\npid {pid}: RSS {rss_warm / 1024:.1f} -> {rss_end / 1024:.1f} MiB, fds "
              f"{fds_warm} -> {fds_end}, threads {threads_warm} -> {threads_end}; {outcomes}")
        assert rss_end <= rss_warm * 1.05 + 16 * 1024, (pid, rss_warm, rss_end)
        assert fds_end <= fds_warm + 2, (pid, fds_warm, fds_end)
        assert threads_end <= threads_warm + 1, (pid, threads_warm, threads_end)
