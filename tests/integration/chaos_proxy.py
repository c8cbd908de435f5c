"""A ZeroMQ proxy between the planes that drops, duplicates, delays and corrupts frames.

Data planes connect to its ROUTER; for each of them it opens a DEALER to the control plane with
the same routing id, so the control plane sees the data plane's identity. Runs as its own
process (`ChaosProxyProcess`), so it never waits on the test process's GIL; it writes its fault
counts to a JSON file as it goes.

    python -m tests.integration.chaos_proxy LISTEN UPSTREAM STATS_FILE [--drop P ...]
"""

import argparse
import dataclasses
import heapq
import itertools
import json
import pathlib
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import zmq


@dataclass
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    max_delay_s: float = 0.03
    corrupt: float = 0.0
    seed: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("forwarded", "dropped", "duplicated", "delayed", "corrupted"), 0))


class ChaosProxy:
    def __init__(self, listen: str, upstream: str, faults: Faults,
                 stats_file: pathlib.Path | None = None) -> None:
        self.listen = listen
        self.upstream = upstream
        self.faults = faults
        self.stats_file = stats_file
        self._stats_written = 0.0
        self._rng = random.Random(faults.seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._later: list[tuple[float, int, zmq.Socket, list[bytes]]] = []
        self._order = itertools.count()

    def __enter__(self) -> "ChaosProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        ctx = zmq.Context()
        front = ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        front.bind(self.listen)
        backs: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(5):
                    if sock is front:
                        identity, *frames = front.recv_multipart()
                        if identity not in backs:
                            backs[identity] = self._connect(ctx, identity, poller)
                        self._forward(backs[identity], frames)
                    else:
                        identity = next(i for i, b in backs.items() if b is sock)
                        self._forward(front, [identity, *sock.recv_multipart()], keep=1)
                self._flush_due()
                self._write_stats()
        finally:
            ctx.destroy(linger=0)

    def _write_stats(self) -> None:
        if self.stats_file is not None and time.monotonic() - self._stats_written > 0.2:
            self._stats_written = time.monotonic()
            tmp = self.stats_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.faults.counts))
            tmp.replace(self.stats_file)

    def _connect(self, ctx: zmq.Context, identity: bytes, poller: zmq.Poller) -> zmq.Socket:
        back = ctx.socket(zmq.DEALER)
        back.setsockopt(zmq.LINGER, 0)
        back.setsockopt(zmq.ROUTING_ID, identity)
        back.connect(self.upstream)
        poller.register(back, zmq.POLLIN)
        return back

    def _forward(self, sock: zmq.Socket, frames: list[bytes], keep: int = 0) -> None:
        """Apply the faults to `frames` (leaving the first `keep` frames, the routing, alone)."""
        f, rng, counts = self.faults, self._rng, self.faults.counts
        if rng.random() < f.drop:
            counts["dropped"] += 1
            return
        if rng.random() < f.corrupt and len(frames) > keep and frames[keep]:
            payload = bytearray(frames[keep])
            payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
            frames = [*frames[:keep], bytes(payload), *frames[keep + 1:]]
            counts["corrupted"] += 1
        copies = 2 if rng.random() < f.duplicate else 1
        counts["duplicated"] += copies - 1
        for _ in range(copies):
            if rng.random() < f.delay:
                counts["delayed"] += 1
                due = time.monotonic() + rng.uniform(0, f.max_delay_s)
                heapq.heappush(self._later, (due, next(self._order), sock, frames))
            else:
                self._send(sock, frames)

    def _send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            self.faults.counts["forwarded"] += 1
        except zmq.ZMQError:
            pass  # the peer went away: the frame is lost, as on a real network

    def _flush_due(self) -> None:
        now = time.monotonic()
        while self._later and self._later[0][0] <= now:
            _, _, sock, frames = heapq.heappop(self._later)
            self._send(sock, frames)


class ChaosProxyProcess:
    """The proxy in a child process; `counts()` reads its latest fault counts."""

    def __init__(self, listen: str, upstream: str, faults: Faults, stats_file: pathlib.Path) -> None:
        self.stats_file = stats_file
        options = [f"--{name.replace('_', '-')}={getattr(faults, name)}"
                   for name in ("drop", "duplicate", "delay", "max_delay_s", "corrupt", "seed")]
        self.popen = subprocess.Popen([sys.executable, "-m", "tests.integration.chaos_proxy",
                                       listen, upstream, str(stats_file), *options])

    def counts(self) -> dict[str, int]:
        return json.loads(self.stats_file.read_text()) if self.stats_file.exists() else {}

    def __enter__(self) -> "ChaosProxyProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.popen.kill()
        self.popen.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("listen")
    parser.add_argument("upstream")
    parser.add_argument("stats_file", type=pathlib.Path)
    for f in dataclasses.fields(Faults):
        if f.name != "counts":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(parser.parse_args())
    listen, upstream, stats = args.pop("listen"), args.pop("upstream"), args.pop("stats_file")
    proxy = ChaosProxy(listen, upstream, Faults(**args), stats)
    proxy._run()


if __name__ == "__main__":
    main()
