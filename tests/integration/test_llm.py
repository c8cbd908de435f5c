"""The in-process mode: the same engine and model runner, no ZeroMQ and no gRPC."""

import pytest

from common.wire import pack_i32
from controlplane.validation import ValidationError
from splitserve.llm import LLM
from tests.reference import hf_greedy

pytestmark = pytest.mark.timeout(300)


def test_in_process_greedy_equals_transformers(checkpoints):
    model = checkpoints["untied"]
    llm = LLM(model, block_size=4, num_kv_blocks=64, max_num_seqs=4)
    try:
        prompts = [[5, 17, 99, 3], [11], list(range(60, 80))]
        completions = llm.generate(prompts, max_tokens=10, temperature=0, ignore_eos=True)
        again = llm.generate(["The quick brown fox"], max_tokens=5, temperature=0, ignore_eos=True)
        with pytest.raises(ValidationError, match=r"^prompt\[1\]: token id -3 is outside"):
            llm.generate([[5], [5, -3]], max_tokens=2)
        assert not llm.engine.streams  # the valid first prompt was not started either
        with pytest.raises(TypeError, match="unknown sampling parameters: \\['max_token'\\]"):
            llm.generate([[5]], max_token=2)
    finally:
        llm.close()
    assert [c.token_ids for c in completions] == [hf_greedy(model, p, 10) for p in prompts]
    assert again[0].completion_tokens == 5 and again[0].finish_reason == "length"


def test_in_process_greedy_with_three_steps_in_flight_equals_transformers(checkpoints):
    model = checkpoints["untied"]
    llm = LLM(model, block_size=4, num_kv_blocks=64, max_num_seqs=4, pipeline_depth=3)
    prompts = [[5, 17, 99, 3], [11], list(range(60, 80))]
    try:
        completions = llm.generate(prompts, per_prompt=[{"max_tokens": n} for n in (10, 2, 7)],
                                   temperature=0, ignore_eos=True)
    finally:
        llm.close()
    assert [c.token_ids for c in completions] == [hf_greedy(model, p, n)
                                                  for p, n in zip(prompts, (10, 2, 7))]


def test_an_engine_that_stops_fails_generate_instead_of_hanging_it(checkpoints):
    """An answer that cannot be (a token outside the vocabulary) is a bug in the in-process data
    plane: the engine loop stops, and generate raises what stopped it."""
    llm = LLM(checkpoints["untied"], block_size=4, num_kv_blocks=64, max_num_seqs=4,
              tune_gc=False)
    execute = llm.dataplane.execute

    async def answering_nonsense(step, epoch, timeout_s):
        result = await execute(step, epoch, timeout_s)
        if result.sampled_token_ids:
            result.sampled_token_ids = pack_i32([10 ** 6])
        return result
    llm.dataplane.execute = answering_nonsense
    try:
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            llm.generate([[1, 2, 3]], max_tokens=3)
    finally:
        llm.close()
