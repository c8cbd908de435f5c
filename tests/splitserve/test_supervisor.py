"""The supervisor's crash budget, with real child processes."""

import asyncio
import sys

import pytest

from splitserve.supervisor import Supervisor

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
