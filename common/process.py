"""Process helpers shared by the launchers."""

import asyncio
import ctypes
import gc
import os
import signal
import sys

# Young-generation collections every 10k allocations instead of 700: a step allocates a few
# objects per request, and with the default the collector ran many times per step (measured
# with bench/engine_cpu.py: 0.96 -> 0.75 ms of engine time per step, 256 streams). Not more:
# a collection walks every object that survived since the last one (KV blocks, requests), and
# at 50k workload A's one collection on the H200 took 20-28 ms, the longest wait of the device
# in the run (bench/throughput.py's host_pauses and longest_gaps, 1f5cb14 and 76a6a4d).
_GC_THRESHOLDS = (10_000, 20, 100)


def tune_gc() -> None:
    """For a serving loop: collect young objects less often, and move everything alive now
    (modules, the model's Python objects) out of the collector's sight."""
    gc.set_threshold(*_GC_THRESHOLDS)
    gc.freeze()


def die_with_parent(parent_pid: int) -> None:
    """Called first thing in a child: get SIGKILL when the parent dies (Linux), so no data-plane
    rank outlives the process that started it. Exits at once if the parent is already gone.

    Set in the child rather than in a pre-exec hook, so the parent never has to fork() with
    gRPC's threads running."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


class StopSignals:
    """SIGTERM and SIGINT, handled in the event loop from the moment this is made: a server
    command makes it first, so that a signal while it starts stops it as cleanly as one while it
    serves (Ctrl-C printed asyncio's KeyboardInterrupt traceback, and left what had started)."""

    def __init__(self) -> None:
        self.first: str | None = None  # the first signal's name
        self.event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.first = self.first or sig.name
        self.event.set()
