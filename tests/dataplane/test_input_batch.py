"""InputBatch's sampling batches: rebuilt when what they depend on changes, reused otherwise."""

import pytest
import torch

from common.wire import pack_i32
from dataplane.input_batch import BatchLimits, InputBatch
from dataplane.sampler import SamplingBatch
from protos import link_pb2
from tests.dataplane.steps import Sched, greedy, make_step

LIMITS = BatchLimits(max_num_seqs=4, max_model_len=32, max_num_batched_tokens=64, block_size=8,
                     vocab_size=50)


def _sample(batch: InputBatch, step: link_pb2.Step) -> SamplingBatch:
    """One step through the host side, as the model runner takes it: deltas applied, inputs
    staged, the sampling batch built, its tokens recorded (token 7 for every row)."""
    inputs = batch.stage(*batch.apply(step))
    sampling = batch.sampling_batch(inputs)
    batch.append_sampled(inputs, torch.full((len(inputs.sampled_slots),), 7))
    return sampling


def _prompt(slot: int, sampling: link_pb2.SamplingOptions | None = None) -> Sched:
    return Sched(slot, 0, 3, [slot], new_tokens=[1, 2, 3], sampling=sampling)


def _decode(slot: int, num_computed: int) -> Sched:
    return Sched(slot, num_computed, 1, [])


def test_decode_steps_on_the_same_slots_share_one_batch():
    batch = InputBatch(LIMITS, torch.device("cpu"))
    first = _sample(batch, make_step(1, [_prompt(0), _prompt(1)]))
    second = _sample(batch, make_step(2, [_decode(0, 3), _decode(1, 3)]))
    assert second is first
    # another set of rows, then a new request's parameters: built afresh each time
    alone = _sample(batch, make_step(3, [_decode(0, 4)]))
    assert alone is not first and alone.temperature.shape == (1,)
    hot = link_pb2.SamplingOptions(temperature=0.5, top_p=0.9, repetition_penalty=1)
    joined = _sample(batch, make_step(4, [_decode(0, 5), _prompt(2, hot)]))
    assert joined.temperature.tolist() == [0.0, 0.5] and joined.uses.top_p
    assert _sample(batch, make_step(5, [_decode(0, 6), _decode(2, 3)])) is joined


@pytest.mark.parametrize("options", [
    dict(seed=3),  # its draws are keyed by the output index, which moves every step
    dict(presence_penalty=0.5),  # its counts move every step
], ids=["seed", "penalty"])
def test_batches_that_change_every_step_are_rebuilt(options):
    batch = InputBatch(LIMITS, torch.device("cpu"))
    sampling = link_pb2.SamplingOptions(temperature=1, top_p=1, repetition_penalty=1, **options)
    first = _sample(batch, make_step(1, [_prompt(0, sampling)]))
    second = _sample(batch, make_step(2, [_decode(0, 3)]))
    assert second is not first
    if "seed" in options:
        assert (first.output_index, second.output_index) == ([0], [1])
    else:
        assert second.output_counts[0, 7] == 1 and first.output_counts[0, 7] == 0


def test_min_tokens_suppression_is_rebuilt_until_it_ends():
    batch = InputBatch(LIMITS, torch.device("cpu"))
    sampling = greedy()
    sampling.min_tokens = 2
    sampling.suppressed_token_ids = pack_i32([5])
    batches = [_sample(batch, make_step(1, [_prompt(0, sampling)]))]
    for step_id, num_computed in [(2, 3), (3, 4), (4, 5)]:
        batches.append(_sample(batch, make_step(step_id, [_decode(0, num_computed)])))
    assert [b.suppress_mask is not None for b in batches] == [True, True, False, False]
    assert batches[0].suppress_mask[0, 5] and batches[1] is not batches[0]
    assert batches[3] is batches[2]
