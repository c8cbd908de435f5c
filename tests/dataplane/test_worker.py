"""Rank 0's loop: steps run once and in the order they were sent, whatever the link does."""

from types import SimpleNamespace

from dataplane.worker import Liveness, Rank0
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
