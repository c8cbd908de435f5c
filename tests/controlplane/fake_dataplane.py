"""A fake data plane for engine unit tests: it keeps each slot's token count like the real one
and 'samples' a token that is a function of the request's whole history, so recomputation
mistakes show up in the outputs. Faults are injected by the test."""

import asyncio

from common.wire import pack_i32, unpack_i32
from controlplane.dataplane_client import DataPlaneInfo, DataPlaneLost
from protos import link_pb2


class FakeDataPlane:
    def __init__(self, num_kv_blocks: int = 64, block_size: int = 4) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.epoch = 0
        self.attached = asyncio.Event()
        self.tokens: dict[int, list[int]] = {}
        self.fail_at_step: tuple[int, DataPlaneLost] | None = None  # (step number, error to raise)
        self.poison_token: int | None = None  # a step with a request holding it fails
        self.num_steps = 0
        self.dropped: str | None = None  # why the engine gave up on it
        self.last_loss_reason: str | None = None  # (DataPlaneClient)

    @property
    def is_attached(self) -> bool:
        return self.attached.is_set()

    def connect(self) -> None:
        """A (new) data plane attaches: fresh state, new epoch."""
        self.epoch += 1
        self.tokens = {}
        self.attached.set()

    def disconnect(self, reason: str = "the fake data plane went") -> None:
        self.attached.clear()
        self.last_loss_reason = reason

    def drop(self, reason: str) -> None:
        self.dropped = reason
        self.disconnect(reason)

    async def attach(self) -> DataPlaneInfo:
        await self.attached.wait()
        return DataPlaneInfo(self.epoch, f"fake-{self.epoch}", self.num_kv_blocks, self.block_size,
                             1, "float32", "cpu", "fake")

    async def execute(self, step: link_pb2.Step, epoch: int, timeout_s: float) -> link_pb2.StepResult:
        await asyncio.sleep(0)
        if not self.is_attached or epoch != self.epoch:
            raise DataPlaneLost("fake data plane gone")
        self.num_steps += 1
        for slot in unpack_i32(step.freed_slots):
            self.tokens.pop(slot, None)
        for new in step.new_requests:
            self.tokens[new.slot] = list(unpack_i32(new.token_ids))
        slots = unpack_i32(step.slots)
        if self.poison_token is not None and any(self.poison_token in self.tokens[s] for s in slots):
            self.disconnect()
            raise DataPlaneLost("poisoned step", step.step_id)
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step[0]:
            error, self.fail_at_step = self.fail_at_step[1], None
            self.disconnect()
            raise error
        sampled = []
        for slot, start, n in zip(slots, unpack_i32(step.num_computed_tokens),
                                  unpack_i32(step.num_scheduled_tokens)):
            history = self.tokens[slot]
            if start + n == len(history):
                token = (sum(history) * 31 + len(history)) % 97
                history.append(token)
                sampled.append(token)
        return link_pb2.StepResult(step_id=step.step_id, sampled_token_ids=pack_i32(sampled))
