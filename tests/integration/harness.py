"""Real server processes for end-to-end tests: `splitserve serve`, or the two planes started as
separate commands. Every wait is bounded; a server that does not come up fails the test with
its log."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from common.transport import free_tcp_port as free_port  # noqa: F401 (harness.free_port)
from splitserve.client import Client

START_TIMEOUT_S = 120


class Process:
    """A `python -m splitserve ...` child with its output in a log file."""

    def __init__(self, args: list[str], log_path: pathlib.Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", "splitserve", *args], stdout=self._log,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log())
            if match:
                return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not in the log of {self.popen.args}:\n{self.log()}")

    def stop(self, timeout_s: float = 20) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.dump_stacks()
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout_s)
        self._log.close()
        return self.popen.returncode

    def dump_stacks(self) -> None:
        """Ask a stuck process for its threads' stacks (into its log; see splitserve.cli)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGUSR1)
            time.sleep(1)


class Server:
    """A running control plane (with or without data planes) and a client for it."""

    def __init__(self, processes: list[Process], port: int) -> None:
        self.processes = processes
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.client = Client(self.address)

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> "Server":
        if not self.client.wait_until_serving(timeout_s):
            raise AssertionError("not SERVING in time:\n" + "\n".join(p.log() for p in self.processes))
        return self

    def log(self) -> str:
        return "\n".join(p.log() for p in self.processes)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Nothing running or waiting and no KV block in use (cancellations reach the engine
        asynchronously, so this waits, bounded)."""
        def idle() -> bool:
            load = self.client.load()
            return (load.num_running, load.num_waiting, load.kv_blocks_used) == (0, 0, 0)
        return wait_until(idle, timeout_s)

    def stop(self) -> None:
        self.client.close()
        for process in reversed(self.processes):
            process.stop()


def serve(model: pathlib.Path, tmp: pathlib.Path, *extra: str) -> Server:
    """`splitserve serve` on a free port, SERVING once returned."""
    tmp.mkdir(parents=True, exist_ok=True)
    process = Process(["serve", "--model", str(model), "--port", "0", *extra], tmp / "serve.log")
    port = int(process.wait_for_log(r"serving gRPC on [\d.]+:(\d+)").group(1))
    return Server([process], port).wait_serving()


def controlplane(model: pathlib.Path, tmp: pathlib.Path, link_address: str, *extra: str) -> Server:
    process = Process(["controlplane", "--model", str(model), "--port", "0",
                       "--dataplane-address", link_address, *extra], tmp / "controlplane.log")
    port = int(process.wait_for_log(r"serving gRPC on [\d.]+:(\d+)").group(1))
    return Server([process], port)


def dataplane(model: pathlib.Path, tmp: pathlib.Path, link_address: str, *extra: str,
              name: str = "dataplane") -> Process:
    return Process(["dataplane", "--model", str(model), "--controlplane-address", link_address,
                    *extra], tmp / f"{name}.log")


async def stream_outcome(call, cancel_after: int | None = None) -> str:
    """Read an async Generate stream: "done", "cancelled" (we cancelled it after
    `cancel_after` chunks) or the gRPC status name it ended with."""
    import asyncio
    import grpc
    received = 0
    try:
        async for _ in call:
            received += 1
            if received == cancel_after:
                call.cancel()
                return "cancelled"
    except grpc.aio.AioRpcError as e:
        return e.code().name
    except asyncio.CancelledError:
        return "cancelled"
    return "done"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # zombies are gone already, only not reaped
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out.extend(children)
        todo.extend(children)
    return out


def cmdline(pid: int) -> str:
    """The process's command line, words joined by spaces ("" once it is gone)."""
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until true or `timeout_s` passes (for states that settle
    asynchronously, such as a process exiting); returns the last result."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
