import pytest

from controlplane.request import FinishReason, RequestStatus
from tests.controlplane.factories import (check, lose_dataplane, make_request, make_scheduler,
                                         run_to_completion, step)


def summary(out):
    return [(s.request.request_id, s.num_tokens, s.new_block_ids, s.is_new, s.samples)
            for s in out.scheduled]


def test_continuous_batching_prefills_then_decodes_together():
    s = make_scheduler()
    for rid, n in (("a", 6), ("b", 5), ("c", 3)):
        s.add(make_request(rid, n, max_tokens=3))
    assert summary(step(s)) == [("a", 6, [0, 1], True, True), ("b", 5, [2, 3], True, True),
                                ("c", 3, [4], True, True)]
    assert summary(step(s)) == [("a", 1, [], False, True), ("b", 1, [], False, True),
                                ("c", 1, [], False, True)]
    s.add(make_request("d", 2, max_tokens=1))
    # a's 8th token needs no block; b's 7th fits; c's 5th token opens a new block; d joins
    assert summary(step(s)) == [("a", 1, [], False, True), ("b", 1, [], False, True),
                                ("c", 1, [5], False, True), ("d", 2, [6], True, True)]
    assert all(r.finish_reason is FinishReason.LENGTH for r in (s.running or []))
    assert s.num_unfinished == 0 and s.kv.num_used_blocks == 0


def test_chunked_prefill_shares_steps_with_decodes():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add(make_request("short", 3, max_tokens=5))
    step(s)
    s.add(make_request("long", 17, max_tokens=1))
    assert summary(step(s)) == [("short", 1, [], False, True), ("long", 7, [1, 2], True, False)]
    # short's 5th token opens a block; long's second chunk takes the next two
    assert summary(step(s)) == [("short", 1, [3], False, True), ("long", 7, [4, 5], False, False)]
    assert summary(step(s)) == [("short", 1, [], False, True), ("long", 3, [6], False, True)]


def test_sequence_cap_holds_back_admissions():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add(make_request(rid, 2, max_tokens=2))
    assert [x.request.request_id for x in step(s).scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    step(s)  # a and b finish (2 tokens each)
    assert [x.request.request_id for x in step(s).scheduled] == ["c"]


def test_preemption_recomputes_the_newest_and_outputs_are_unchanged():
    def outputs(num_blocks):
        s = make_scheduler(num_blocks=num_blocks)
        requests = [make_request(rid, n, max_tokens=10) for rid, n in (("a", 7), ("b", 6), ("c", 5))]
        for r in requests:
            s.add(r)
        run_to_completion(s)
        return [r.output_token_ids for r in requests], sum(r.num_preemptions for r in requests)

    roomy, no_preemptions = outputs(num_blocks=32)
    tight, preemptions = outputs(num_blocks=9)
    assert no_preemptions == 0 and preemptions > 0
    assert tight == roomy


def test_preempted_request_is_readmitted_from_the_prefix_cache():
    s = make_scheduler(num_blocks=5)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", list(range(200, 208)), max_tokens=8)
    s.add(a)
    s.add(b)
    step(s)
    assert s.kv.num_free_blocks == 1
    while b.status is RequestStatus.RUNNING:
        step(s)
    assert b.status is RequestStatus.PREEMPTED and s.waiting[0] is b
    while b.status is not RequestStatus.RUNNING:
        out = step(s)
    [scheduled] = [x for x in out.scheduled if x.request is b]
    # Back with its 9 tokens. Its blocks [2, 3] were freed tail first, so a's growth reused 3
    # and evicted it; block 2 (its first 4 tokens) comes back from the prefix cache.
    assert scheduled.is_new and scheduled.new_block_ids[0] == 2 and scheduled.num_tokens == 9 - 4


def test_finish_while_in_flight_frees_at_once_and_the_result_is_ignored():
    s = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 5)
    s.add(a)
    s.add(b)
    out = s.schedule()
    slot = a.slot
    s.finish(a, FinishReason.ABORTED)
    assert "a" not in s.kv.req_to_blocks
    produced = s.update(out, [1, 2])
    assert [(r.request_id, i) for r, i in produced] == [("b", 1)]
    assert a.output_token_ids == [] and b.output_token_ids == [2]
    assert slot in s.schedule().freed_slots
    check(s)


def test_waiting_request_can_be_finished():
    s = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 3), make_request("b", 3)
    s.add(a)
    s.add(b)
    step(s)
    s.finish(b, FinishReason.ABORTED)
    assert list(s.waiting) == [] and b.finish_reason is FinishReason.ABORTED
    check(s)


def test_preempt_all_requeues_running_in_order_ahead_of_waiting():
    s = make_scheduler(max_num_seqs=2)
    reqs = [make_request(rid, 3) for rid in "abc"]
    for r in reqs:
        s.add(r)
    step(s)
    lost = s.preempt_all()
    assert [r.request_id for r in lost] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]
    assert all(r.num_computed_tokens == 0 for r in reqs)


def test_suspects_run_alone_until_they_sample_then_rejoin_the_batch():
    s = make_scheduler()
    reqs = [make_request(rid, [i] * 5, max_tokens=4) for i, rid in enumerate("abc")]
    for r in reqs:
        s.add(r)
    step(s)
    lose_dataplane(s, 16)
    assert [r.is_suspect for r in reqs] == [True] * 3
    assert summary(step(s)) == [("a", 6, [0, 1], True, True)]  # recompute prompt + 1 output
    assert summary(step(s)) == [("b", 6, [2, 3], True, True)]  # a waits: b runs alone
    assert summary(step(s)) == [("c", 6, [4, 5], True, True)]
    assert [x.request.request_id for x in step(s).scheduled] == ["a", "b", "c"]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_suspect_that_needs_a_runners_blocks_is_the_one_admitted(depth):
    """After a loss, the new data plane's cache fits one request at a time. Once `a` has its
    token, suspect `b` needs a's blocks: a is preempted and queued behind b, not ahead of it (a
    re-admitted from scratch, its 12-token recompute a chunk of the 12-token budget short of a
    token, would be preempted for b again: a loop that never ends without prefix caching). With
    two steps in flight a's token may still be unknown when b needs its blocks."""
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=12, prefix_caching=False)
    a, b = make_request("a", 12, max_tokens=8), make_request("b", list(range(200, 212)), max_tokens=4)
    s.add(a)
    s.add(b)
    for _ in range(3):
        step(s)
    lose_dataplane(s, num_blocks=5)
    run_to_completion(s, max_steps=100, depth=depth)
    assert [r.finish_reason for r in (a, b)] == [FinishReason.LENGTH] * 2
    assert s.kv.num_used_blocks == 0


def test_two_steps_in_flight_give_the_same_outputs_as_one():
    """Scheduling a step before the previous one's tokens are known (placeholders) changes
    nothing in the outputs, also with preemption and with stop ids ending requests early."""
    def outputs(depth, num_blocks):
        s = make_scheduler(num_blocks=num_blocks)
        reqs = [make_request(rid, [i + 1] * (3 + 2 * i), max_tokens=9 + i, stop_token_ids=(13,))
                for i, rid in enumerate("abcd")]
        for r in reqs:
            s.add(r)
        run_to_completion(s, max_steps=200, depth=depth)
        return [(r.output_token_ids, r.finish_reason) for r in reqs], s.kv.num_used_blocks

    assert outputs(2, 32) == outputs(1, 32)
    assert outputs(2, 10) == outputs(1, 32)  # with preemptions
    assert outputs(2, 10)[1] == 0


def test_the_queue_counts_waiting_requests_beyond_free_slots_or_all_when_blocks_ran_out():
    s = make_scheduler(num_blocks=4, max_num_seqs=4)
    for rid in "abc":
        s.add(make_request(rid, 8, max_tokens=4))  # two blocks of 4 tokens each
    assert s.num_queued() == 0 and s.num_queued(num_new=2) == 1  # three of four slots taken
    step(s)  # a and b fill the cache; c waits for blocks, two slots free
    assert [r.request_id for r in s.running] == ["a", "b"] and len(s.waiting) == 1
    assert s.num_queued() == 1 and s.num_queued(num_new=1) == 2
    run_to_completion(s)
    assert s.num_queued(num_new=1) == 0
