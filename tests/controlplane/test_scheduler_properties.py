"""Random sequences of add / step / finish against the invariants, after every operation."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.request import FinishReason
from tests.controlplane.factories import (check, land, launch, lose_dataplane, make_request,
                                         make_scheduler, run_to_completion, step)

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 12), st.integers(0, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("lose")),
    st.tuples(st.just("launch")),  # schedule ahead: up to two steps in flight
    st.tuples(st.just("land")),
), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(6, 24), budget=st.integers(4, 32),
       max_num_seqs=st.integers(1, 4), prefix_caching=st.booleans())
def test_invariants_hold_under_any_sequence(ops, num_blocks, budget, max_num_seqs, prefix_caching):
    s = make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, max_model_len=40, prefix_caching=prefix_caching)
    requests = []
    in_flight = []
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, family = op
            # prompts of one family share a prefix, so the prefix cache gets hits
            prompt = [family] * (prompt_len // 2) + list(range(len(requests), len(requests) + prompt_len - prompt_len // 2))
            request = make_request(f"r{len(requests)}", prompt, max_tokens=max_tokens)
            requests.append(request)
            s.add(request)
        elif op[0] == "step":
            while in_flight:
                land(s, in_flight.pop(0))
            step(s)
        elif op[0] == "launch" and len(in_flight) < 2:
            in_flight.append(launch(s))
        elif op[0] == "land" and in_flight:
            land(s, in_flight.pop(0))
        elif op[0] == "lose":
            in_flight.clear()  # their results never come
            lose_dataplane(s, num_blocks)
        elif op[0] == "finish" and requests:
            s.finish(requests[op[1] % len(requests)], FinishReason.ABORTED)
        check(s)
    while in_flight:
        land(s, in_flight.pop(0))
    run_to_completion(s)
    assert s.kv.num_used_blocks == 0
    assert sorted(s.free_slots) == list(range(max_num_seqs))
    for request in requests:
        assert request.is_finished
        if request.finish_reason is FinishReason.LENGTH:
            assert request.num_output_tokens == request.sampling.max_tokens
