"""The in-process mode: the same engine and model runner, no ZeroMQ and no gRPC."""

import pytest

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
    finally:
        llm.close()
    assert [c.token_ids for c in completions] == [hf_greedy(model, p, 10) for p in prompts]
    assert again[0].completion_tokens == 5 and again[0].finish_reason == "length"
