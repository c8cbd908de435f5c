"""Keeps a locally spawned child running (the data plane of `splitserve serve`, the control
plane's gRPC front-ends): restarts it with exponential backoff, within a crash budget. The child
dies with this process (--parent-pid) and runs in a session of its own, so a signal to this
process's group (Ctrl-C, `docker stop` through dumb-init) reaches only this process, which
drains and then stops its children in order."""

import asyncio
import logging
import os
import signal
import time

log = logging.getLogger("splitserve.supervisor")


class Supervisor:
    def __init__(self, argv: list[str], name: str, max_restarts: int = 10,
                 window_s: float = 120.0, max_backoff_s: float = 10.0,
                 healthy_after_s: float = 30.0) -> None:
        self.argv = argv
        self.name = name
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self.process: asyncio.subprocess.Process | None = None
        self.task: asyncio.Task | None = None  # the run loop; ends when it gives up
        self._stopping = False
        self._restarts: list[float] = []

    def start(self) -> "Supervisor":
        self.task = asyncio.create_task(self.run(), name=f"supervise {self.name}")
        return self

    async def run(self) -> None:
        backoff = 0.5
        while not self._stopping:
            started = time.monotonic()
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, "--parent-pid", str(os.getpid()), start_new_session=True)
            code = await self.process.wait()
            if self._stopping:
                return
            now = time.monotonic()
            if now - started > self.healthy_after_s:
                backoff = 0.5  # it ran a good while: a fresh crash, not a crash loop
            self._restarts = [t for t in self._restarts if now - t < self.window_s] + [now]
            if len(self._restarts) > self.max_restarts:
                log.error("%s exited (code %s) %d times in %.0fs; not restarting it again",
                          self.name, code, len(self._restarts), self.window_s)
                return
            log.warning("%s exited with code %s; restarting in %.1fs", self.name, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def restart(self) -> None:
        """Kill the child (the run loop starts a new one): for a data plane the control plane
        declared lost but which may still run, frozen or hung."""
        process = self.process
        if process is not None and process.returncode is None and not self._stopping:
            log.warning("killing %s pid %d (declared lost)", self.name, process.pid)
            process.kill()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM the child (SIGKILL after `timeout_s`) and end the run loop."""
        self._stopping = True
        process = self.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self.task is not None:
            self.task.cancel()
