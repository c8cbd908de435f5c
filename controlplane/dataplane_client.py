"""What the engine needs from a data plane. The ZeroMQ link implements it; so do test fakes and
the in-process data plane."""

from dataclasses import dataclass
from typing import Protocol

from protos import link_pb2


class DataPlaneLost(Exception):
    """The data plane died, hung, or was replaced; its KV cache is gone. `failed_step_id`: it
    reported that running this step raised (that step's requests are suspects). Every step in
    flight fails with the same error, whichever one it names."""

    def __init__(self, reason: str, failed_step_id: int | None = None) -> None:
        super().__init__(reason)
        self.failed_step_id = failed_step_id


@dataclass(frozen=True)
class DataPlaneInfo:
    """What the handshake reported. `epoch` names this attachment; steps carry it."""

    epoch: int
    instance_id: str
    num_kv_blocks: int
    block_size: int
    tp_size: int
    dtype: str
    device: str
    attention_backend: str


class DataPlaneClient(Protocol):
    @property
    def is_attached(self) -> bool: ...

    @property
    def last_loss_reason(self) -> str | None:
        """Why the last data plane went (None while none has): the engine logs it for a loss it
        notices while no step is in flight, which would otherwise fail with the reason."""
        ...

    async def attach(self) -> DataPlaneInfo:
        """Wait until a data plane has completed its handshake; returns what it reported."""
        ...

    async def execute(self, step: link_pb2.Step, epoch: int, timeout_s: float) -> link_pb2.StepResult:
        """Run one step on the data plane attached in `epoch`. Raises DataPlaneLost if that data
        plane is gone, goes while the step runs, or does not answer within `timeout_s`."""
        ...

    def drop(self, reason: str) -> None:
        """Give up on the attached data plane (it answered what cannot be): it is told to go,
        its steps in flight fail with DataPlaneLost, and attach() waits for another."""
        ...
