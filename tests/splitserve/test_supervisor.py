"""The supervisor's crash budget, with real child processes."""

import asyncio
import os
import signal
import sys

import pytest

from splitserve.supervisor import Supervisor
from tests.integration import harness

pytestmark = pytest.mark.timeout(60)


def exits_after(seconds: float) -> list[str]:
    """A child that exits with code 3 after `seconds` (it ignores the --parent-pid it gets)."""
    return [sys.executable, "-c", f"import sys, time; time.sleep({seconds}); sys.exit(3)"]


def test_a_crash_loop_is_given_up_after_max_restarts_quick_exits_in_a_row():
    """(The rule was more than max_restarts exits within 2 minutes, which the backoff let only
    children that died within ~5 s of starting reach: a slower crash loop ran forever.)"""
    async def run():
        supervisor = Supervisor(exits_after(0.3), "child", max_restarts=3, healthy_after_s=5,
                                min_backoff_s=0.01, max_backoff_s=0.05).start()
        await asyncio.wait_for(supervisor.task, 30)  # it gives up: the loop ends
        return supervisor.process.returncode

    assert asyncio.run(run()) == 3


def test_a_child_that_ran_a_good_while_starts_the_count_anew():
    async def run():
        supervisor = Supervisor(exits_after(0.3), "child", max_restarts=1, healthy_after_s=0.2,
                                min_backoff_s=0.01).start()
        await asyncio.sleep(3)  # ~8 exits, each after its healthy time: still restarting
        is_running = not supervisor.task.done()
        await supervisor.stop()
        return is_running

    assert asyncio.run(run())


def test_a_child_declared_lost_after_it_died_is_not_killed_and_its_end_is_logged(caplog):
    """The control plane can declare a data plane lost (its connection dropped) before this
    process has reaped it: the supervisor logged 'killing child pid N (declared lost)' for a
    process that had died, and then only its exit code."""
    async def run():
        supervisor = Supervisor(exits_after(60), "child", min_backoff_s=0.01).start()
        while supervisor.process is None:
            await asyncio.sleep(0.01)
        dead = supervisor.process.pid
        os.kill(dead, signal.SIGKILL)
        # (blocking the loop: its child watcher cannot report the exit before restart())
        assert harness.wait_until(lambda: not harness.alive(dead), 10)
        supervisor.restart()
        while supervisor.process.pid == dead:  # restarted
            await asyncio.sleep(0.01)
        await supervisor.stop()

    with caplog.at_level("INFO", logger="splitserve.supervisor"):
        asyncio.run(asyncio.wait_for(run(), 30))
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "killing" in m], messages
    assert "child was killed by SIGKILL; restarting in 0.0s" in messages, messages
