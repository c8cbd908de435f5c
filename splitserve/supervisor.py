"""Keeps a locally spawned child running (the data plane of `splitserve serve`, the control
plane's gRPC front-ends): restarts it with exponential backoff, and gives up after more than
`max_restarts` exits in a row each within `healthy_after_s` of its start (a crash loop; one that
ran longer is a fresh crash: it starts the count and the backoff anew). The child
dies with this process (--parent-pid) and runs in a session of its own, so a signal to this
process's group (Ctrl-C, `docker stop` through dumb-init) reaches only this process, which
drains and then stops its children in order."""

import asyncio
import logging
import os
import signal
import time

from common.errors import ConfigError

log = logging.getLogger("splitserve.supervisor")


class Supervisor:
    def __init__(self, argv: list[str], name: str, max_restarts: int = 10,
                 healthy_after_s: float = 30.0, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0) -> None:
        self.argv = argv
        self.name = name
        self.max_restarts = max_restarts
        self.healthy_after_s = healthy_after_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.process: asyncio.subprocess.Process | None = None
        self.task: asyncio.Task | None = None  # the run loop; ends when it gives up
        self._stopping = False

    def start(self) -> "Supervisor":
        self.task = asyncio.create_task(self.run(), name=f"supervise {self.name}")
        return self

    async def run(self) -> None:
        backoff = self.min_backoff_s
        num_quick_exits = 0
        has_run_a_while = False  # (an exit 2 after that is not a refusal of its flags)
        while not self._stopping:
            started = time.monotonic()
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, "--parent-pid", str(os.getpid()), start_new_session=True)
            code = await self.process.wait()
            if self._stopping:
                return
            ran_a_while = time.monotonic() - started > self.healthy_after_s
            has_run_a_while |= ran_a_while
            if code == ConfigError.EXIT_CODE and not has_run_a_while:  # it would again
                raise ConfigError(f"the {self.name} refused its configuration (exit code "
                                  f"{code}; its error is above)")
            if ran_a_while:
                backoff, num_quick_exits = self.min_backoff_s, 0  # a fresh crash
            else:
                num_quick_exits += 1
            if num_quick_exits > self.max_restarts:
                log.error("%s exited (code %s) %d times in a row within %.0fs of its start; not "
                          "restarting it again", self.name, code, num_quick_exits,
                          self.healthy_after_s)
                return
            log.warning("%s %s; restarting in %.1fs", self.name, _how_it_ended(code), backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def restart(self) -> None:
        """Kill the child (the run loop starts a new one): for a data plane the control plane
        declared lost but which may still run, frozen or hung. One that has ended already (the
        control plane can see its connection drop before this process reaps it) is left to
        the run loop, which logs how it ended."""
        process = self.process
        if process is None or process.returncode is not None or self._stopping:
            return
        if _has_ended(process.pid):
            log.debug("%s pid %d (declared lost) has ended already", self.name, process.pid)
            return
        log.warning("killing %s pid %d (declared lost)", self.name, process.pid)
        process.kill()

    async def stop(self, timeout_s: float = 5.0, after_failure: bool = False) -> None:
        """SIGTERM the child (SIGKILL after `timeout_s`) and end the run loop. After a failure
        the child's exit is a DEBUG line (the failure's own line is the one to read)."""
        self._stopping = True
        process = self.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
                log.log(logging.DEBUG if after_failure else logging.INFO,
                        "%s exited on SIGTERM (code %s)", self.name, process.returncode)
            except TimeoutError:
                log.warning("%s still runs %.0fs after SIGTERM: killing it", self.name, timeout_s)
                process.kill()
                await process.wait()
        if self.task is not None:
            self.task.cancel()


def _has_ended(pid: int) -> bool:
    """Whether our child `pid` has exited, without reaping it: asyncio's child watcher reaps it
    and hands the run loop its status (a reap here would take that status away)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already; the loop has yet to hear of it
        return True


def _how_it_ended(code: int) -> str:
    """asyncio's returncode in words (a negative one is minus the signal that ended it)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:  # (a real-time signal, say)
        return f"was killed by signal {-code}"
