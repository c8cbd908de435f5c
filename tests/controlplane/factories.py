"""Tiny numbers, so expected block ids can be written by hand."""

from controlplane.kv_manager import KVCacheManager
from controlplane.request import Request
from controlplane.sampling_params import SamplingParams
from controlplane.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int = 8, **sampling) -> Request:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, **sampling))


def make_scheduler(num_blocks: int = 16, max_num_seqs: int = 4, max_num_batched_tokens: int = 64,
                   max_model_len: int = 64, prefix_caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_prefix_caching=prefix_caching)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching))


def check(scheduler: Scheduler) -> None:
    """The invariants after every step."""
    scheduler.kv.check_invariants()
    slots = [r.slot for r in scheduler.running]
    assert None not in slots and len(set(slots)) == len(slots)
    assert set(slots).isdisjoint(scheduler.free_slots)
    assert len(slots) + len(scheduler.free_slots) == scheduler.config.max_num_seqs
    assert all(r.slot is None for r in scheduler.waiting)
    assert set(scheduler.kv.req_to_blocks) <= {r.request_id for r in scheduler.running}
    bs = scheduler.kv.block_size
    for request in scheduler.running:
        blocks = scheduler.kv.req_to_blocks.get(request.request_id, [])
        assert len(blocks) * bs >= request.num_computed_tokens
        for i, block in enumerate(blocks):  # a cached block a request holds holds its tokens
            if block.token_ids is not None:
                assert block.token_ids == tuple(request.token_ids[i * bs:(i + 1) * bs])


def fake_token(request: Request) -> int:
    """A fake data plane's 'sample': a function of the whole token history, so a recompute that
    got any token or position wrong would show up in the outputs."""
    return (sum(request.token_ids) * 31 + request.num_tokens) % 97


def launch(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule one step (its result comes later, see land)."""
    out = scheduler.schedule()
    if any(s.request.is_suspect for s in out.scheduled):
        assert len(out.scheduled) == 1, "a suspect runs alone"
    check(scheduler)
    return out


def land(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Answer a step like a data plane would and apply the result."""
    tokens = [fake_token(s.request) for s in out.scheduled if s.samples]
    scheduler.update(out, tokens)
    check(scheduler)


def step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule one step, answer it, apply it; check invariants."""
    out = launch(scheduler)
    land(scheduler, out)
    return out


def lose_dataplane(scheduler: Scheduler, num_blocks: int) -> None:
    """What the engine does on a failed step: requeue everything, suspect the runners."""
    for request in scheduler.preempt_all():
        request.is_suspect = True
    scheduler.reset_kv(KVCacheManager(num_blocks, BLOCK_SIZE, scheduler.config.enable_prefix_caching))


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000, depth: int = 1) -> int:
    """Steps until every request is done, with up to `depth` of them in flight (the oldest is
    answered once that many are out, or nothing is left to send); returns how many ran."""
    in_flight: list[SchedulerOutput] = []
    for n in range(max_steps):
        while len(in_flight) < depth and scheduler.num_unfinished:
            in_flight.append(launch(scheduler))
        if not in_flight:
            return n
        land(scheduler, in_flight.pop(0))
    raise AssertionError(f"not done after {max_steps} steps")
