"""`splitserve serve --model <qwen3-moe dir>` end to end: greedy generation, the prefix cache,
logprobs and TP=2 equal transformers' Qwen3MoeForCausalLM."""

import pytest

from tests.integration import harness
from tests.integration.test_generate import MAX_TOKENS, PROMPTS, expected, generate_all
from tests.reference import hf_greedy, hf_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model(moe_checkpoints):
    return moe_checkpoints["moe"]


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = harness.serve(model, tmp_path_factory.mktemp("serve_moe"), "--block-size", "4",
                      "--num-kv-blocks", "256")
    yield s
    s.stop()


def test_concurrent_greedy_equals_transformers(server, model):
    completions = generate_all(server, PROMPTS, MAX_TOKENS)
    assert [c.token_ids for c in completions] == expected(model)
    info = server.client.model_info()
    assert info.tp_size == 1


def test_prefix_cache_and_logprobs(server, model):
    prompt = list(range(100, 123))  # 23 tokens: 5 full blocks of 4
    first = server.client.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True)
    second = server.client.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True,
                                    logprobs=5)
    assert (first.cached_tokens, second.cached_tokens) == (0, 20)
    assert first.token_ids == second.token_ids == hf_greedy(model, prompt, 6)
    reference = hf_logprobs(model, prompt + second.token_ids)
    for i, (token, lp) in enumerate(zip(second.token_ids, second.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[token].item()) < 1e-4
        assert [t.token_id for t in lp.top] == row.topk(5).indices.tolist()


def test_tensor_parallel_2_equals_transformers(model, tmp_path):
    server = harness.serve(model, tmp_path, "--tp", "2", "--block-size", "4",
                           "--num-kv-blocks", "128")
    try:
        completions = generate_all(server, PROMPTS[:3], MAX_TOKENS[:3])
        info = server.client.model_info()
    finally:
        server.stop()
    assert info.tp_size == 2
    assert [c.token_ids for c in completions] == expected(model, PROMPTS[:3], MAX_TOKENS[:3])
