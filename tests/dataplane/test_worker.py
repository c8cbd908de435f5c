"""Rank 0's loop: steps run once and in the order they were sent, whatever the link does."""

import threading
from types import SimpleNamespace

import pytest

from dataplane.worker import EpochState, Liveness, Rank0, _configure
from protos import link_pb2


class RecordingRunner:
    """Stands in for the model runner: records which steps were submitted."""

    def __init__(self) -> None:
        self.submitted: list[int] = []

    def submit(self, step: link_pb2.Step):
        self.submitted.append(step.step_id)
        return SimpleNamespace(is_done=lambda: True, step_id=step.step_id, done=None)

    def finish(self, pending):
        return link_pb2.StepResult(step_id=pending.step_id)


def step_message(step_id: int, previous: int) -> tuple[bytes, link_pb2.LinkMessage]:
    message = link_pb2.LinkMessage(epoch=1, step=link_pb2.Step(step_id=step_id,
                                                                previous_step_id=previous))
    return message.SerializeToString(), message


def rank0(runner) -> Rank0:
    link = SimpleNamespace(sent=[], send=lambda m: link.sent.append(m))
    return Rank0(runner, link, Liveness(None))


def test_a_step_that_overtakes_its_lost_predecessor_waits_for_it():
    runner = RecordingRunner()
    loop = rank0(runner)
    loop._on_step(*step_message(7, 0))
    loop._on_step(*step_message(9, 8))  # 8 was lost; its retransmission comes later
    loop._on_step(*step_message(10, 9))
    assert runner.submitted == [7]
    loop._on_step(*step_message(8, 7))
    assert runner.submitted == [7, 8, 9, 10]


def test_a_repeated_step_is_answered_from_the_cache_not_run_again():
    runner = RecordingRunner()
    loop = rank0(runner)
    for payload, message in (step_message(1, 0), step_message(2, 1)):
        loop._on_received(b"msg", payload)
    while loop.pending:
        loop._finish_oldest()
    loop._on_received(b"msg", step_message(1, 0)[0])  # a retransmission of a step that ran
    assert runner.submitted == [1, 2]
    assert [m.step_result.step_id for m in loop.link.sent] == [1, 2, 1]  # the repeat: cached


class DeviceEvent:
    """Stands in for a step's CUDA event: done when the test says so."""

    def __init__(self) -> None:
        self.fired = threading.Event()

    def synchronize(self) -> None:
        self.fired.wait()

    def query(self) -> bool:
        return self.fired.is_set()


@pytest.mark.timeout(30)
def test_rank0_wakes_when_the_device_finishes_a_step_not_at_a_poll_timeout():
    """The completions thread wakes the loop's poll: the fake link waits on it with an hour-long
    timeout, so only that wake-up can finish the step (the test's own timeout would fail it)."""
    event = DeviceEvent()

    class SlowRunner(RecordingRunner):
        def submit(self, step):
            super().submit(step)
            return SimpleNamespace(is_done=event.query, done=event, step_id=step.step_id)

    loop = rank0(SlowRunner())

    def recv_or(other, timeout_s):
        other.poll(3_600_000)
        return None
    loop.link.recv_or = recv_or
    loop._on_step(*step_message(1, 0))
    threading.Timer(0.05, event.fired.set).start()
    loop._finish_oldest()
    assert [m.step_result.step_id for m in loop.link.sent] == [1]
    loop.completions.close()


@pytest.mark.parametrize("arrivals, expected_epoch", [((2, 2), 2), ((2, 3, 2), 3)])
def test_configures_that_arrive_while_the_last_epochs_steps_finish_run_once(arrivals,
                                                                           expected_epoch):
    """The control plane repeats Configure each second until Ready comes; a step of the last
    epoch that takes longer used to configure once per repeat, each inside the one before."""
    event = DeviceEvent()

    class SlowRunner(RecordingRunner):
        block_size = 16
        backend = SimpleNamespace(name="torch")
        configures = 0

        def submit(self, step):
            super().submit(step)
            return SimpleNamespace(is_done=event.query, done=event, step_id=step.step_id)

        def configure(self, limits) -> int:
            self.configures += 1
            return 8

    def configure(epoch: int) -> bytes:
        return link_pb2.LinkMessage(epoch=epoch, configure=link_pb2.Configure()).SerializeToString()

    runner = SlowRunner()
    loop = rank0(runner)
    later = [(b"msg", configure(epoch)) for epoch in arrivals[1:]]

    def recv_or(other, timeout_s):  # the later Configures, then the step's end
        if later:
            return later.pop(0)
        event.fired.set()
        return None
    loop.link.recv_or = recv_or
    loop._on_step(*step_message(1, 0))
    loop._on_received(b"msg", configure(arrivals[0]))
    assert runner.configures == 1
    assert [(m.WhichOneof("body"), m.epoch) for m in loop.link.sent] == \
        [("step_result", 1), ("ready", expected_epoch)]
    loop.completions.close()


def test_the_liveness_file_is_touched_while_configure_runs(tmp_path):
    """Compiles and graph captures can keep the loop away for minutes: a probe's --max-age must
    not count that as a hang."""
    alive = tmp_path / "alive"

    class SlowRunner:
        block_size = 16
        backend = SimpleNamespace(name="torch")

        def configure(self, limits) -> int:  # returns once the file is touched meanwhile
            for _ in range(1000):
                if alive.exists():
                    return 8
                threading.Event().wait(0.01)
            raise AssertionError("not touched while configuring")

    message = link_pb2.LinkMessage(epoch=3, configure=link_pb2.Configure())
    reply = _configure(SlowRunner(), message, EpochState(), Liveness(alive))
    assert reply.ready.num_kv_blocks == 8
