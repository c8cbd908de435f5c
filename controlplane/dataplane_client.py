"""What the engine needs from a data plane. The ZeroMQ link implements it; so do test fakes and
the in-process data plane."""

from dataclasses import dataclass
from typing import Protocol

from protos import link_pb2


class DataPlaneLost(Exception):
    """The data plane died, hung, or was replaced; its KV cache is gone. `step_failed`: it
    reported that running the step raised (the step's requests are suspects)."""

    def __init__(self, reason: str, step_failed: bool = False) -> None:
        super().__init__(reason)
        self.step_failed = step_failed


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

    async def attach(self) -> DataPlaneInfo:
        """Wait until a data plane has completed its handshake; returns what it reported."""
        ...

    async def execute(self, step: link_pb2.Step, epoch: int, timeout_s: float) -> link_pb2.StepResult:
        """Run one step on the data plane attached in `epoch`. Raises DataPlaneLost if that data
        plane is gone, goes while the step runs, or does not answer within `timeout_s`."""
        ...
