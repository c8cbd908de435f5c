"""Hand-built Steps for data-plane tests: requests, chunks and blocks spelled out."""

from dataclasses import dataclass, field

from common.wire import pack_i32
from protos import link_pb2


def greedy() -> link_pb2.SamplingOptions:
    return link_pb2.SamplingOptions(temperature=0, top_p=1, repetition_penalty=1)


@dataclass
class Sched:
    slot: int
    num_computed: int
    num_scheduled: int
    new_blocks: list[int] = field(default_factory=list)
    new_tokens: list[int] | None = None  # set: the request is new in this step
    num_prompt_tokens: int | None = None
    sampling: link_pb2.SamplingOptions | None = None


def make_step(step_id: int, scheduled: list[Sched], freed: list[int] = ()) -> link_pb2.Step:
    step = link_pb2.Step(step_id=step_id, freed_slots=pack_i32(freed))
    for s in scheduled:
        if s.new_tokens is not None:
            step.new_requests.add(slot=s.slot, request_id=f"r{s.slot}",
                                  token_ids=pack_i32(s.new_tokens),
                                  num_prompt_tokens=s.num_prompt_tokens or len(s.new_tokens),
                                  sampling=s.sampling or greedy())
    step.slots = pack_i32(s.slot for s in scheduled)
    step.num_computed_tokens = pack_i32(s.num_computed for s in scheduled)
    step.num_scheduled_tokens = pack_i32(s.num_scheduled for s in scheduled)
    step.num_new_blocks = pack_i32(len(s.new_blocks) for s in scheduled)
    step.new_block_ids = pack_i32(b for s in scheduled for b in s.new_blocks)
    return step


def configure(max_num_seqs: int = 8, max_model_len: int = 256,
              max_num_batched_tokens: int = 1024) -> link_pb2.Configure:
    return link_pb2.Configure(max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, max_logprobs=20)
