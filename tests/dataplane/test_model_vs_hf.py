"""The data plane's logits against transformers' Qwen3ForCausalLM, float32, on seeded random
checkpoints: prefill, chunked prefill, prefill over cached blocks, decode, mixed batches."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from common.wire import unpack_f32, unpack_i32
from dataplane.model_runner import ModelRunner, RunnerConfig
from protos import link_pb2
from tests.dataplane.steps import Sched, configure, make_step

ATOL = 2e-4  # float32: observed differences are ~1e-5 on logits of magnitude ~5
BLOCK = 4


@pytest.fixture(scope="module", params=["untied", "tied", "odd_vocab"])
def pair(request, checkpoints):
    path = checkpoints[request.param]
    runner = ModelRunner.load(RunnerConfig(model_dir=path, block_size=BLOCK, num_kv_blocks=128))
    hf = Qwen3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return runner, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """Logits of every position: [len(tokens), vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def blocks_for(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // BLOCK)))


def test_prefill_batch_matches(pair):
    runner, hf = pair
    runner.configure(configure())
    ps = prompts(runner.vocab_size, [7, 1, 13, 4], seed=0)
    scheds, next_block = [], 0
    for slot, p in enumerate(ps):
        blocks = blocks_for(next_block, len(p))
        next_block += len(blocks)
        scheds.append(Sched(slot, 0, len(p), blocks, new_tokens=p))
    logits, inputs = runner.forward(make_step(1, scheds))
    assert inputs.sampled_slots.tolist() == [0, 1, 2, 3]
    for i, p in enumerate(ps):
        torch.testing.assert_close(logits[i], hf_logits(hf, p)[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches(pair):
    """A prompt prefilled in chunks of 5, 5, 3 (sharing steps with another request's decode),
    then three greedy decode steps: each step's logits equal transformers' on the same tokens."""
    runner, hf = pair
    runner.configure(configure())
    long, short = prompts(runner.vocab_size, [13, 3], seed=1)
    step = make_step(1, [Sched(0, 0, 5, blocks_for(0, 5), new_tokens=long),
                         Sched(1, 0, 3, [10], new_tokens=short)])
    logits, inputs = runner.forward(step)
    assert inputs.sampled_slots.tolist() == [1]  # the chunk did not reach its prompt's end
    torch.testing.assert_close(logits[0], hf_logits(hf, short)[-1], atol=ATOL, rtol=0)
    short = short + [int(logits[0].argmax())]
    runner.batch.append_sampled(inputs, torch.tensor([short[-1]]))
    step = make_step(2, [Sched(0, 5, 5, [2]), Sched(1, 3, 1, [11])])
    logits, inputs = runner.forward(step)
    assert inputs.sampled_slots.tolist() == [1]
    torch.testing.assert_close(logits[0], hf_logits(hf, short)[-1], atol=ATOL, rtol=0)
    logits, inputs = runner.forward(make_step(3, [Sched(0, 10, 3, [3])]))
    torch.testing.assert_close(logits[0], hf_logits(hf, long)[-1], atol=ATOL, rtol=0)
    for step_id in range(4, 7):
        long = long + [int(logits[0].argmax())]
        runner.batch.append_sampled(inputs, torch.tensor([long[-1]]))
        new_blocks = [4 + step_id] if (len(long) - 1) % BLOCK == 0 else []
        logits, inputs = runner.forward(make_step(step_id, [Sched(0, len(long) - 1, 1, new_blocks)]))
        torch.testing.assert_close(logits[0], hf_logits(hf, long)[-1], atol=ATOL, rtol=0)


def test_prefill_over_cached_blocks_matches(pair):
    """A second request starts from the first one's two full blocks (a prefix-cache hit): its
    block table begins with those blocks and only its last tokens are computed."""
    runner, hf = pair
    runner.configure(configure())
    first = prompts(runner.vocab_size, [10], seed=2)[0]
    runner.forward(make_step(1, [Sched(0, 0, 10, [0, 1, 2], new_tokens=first)]))
    second = first[:8] + prompts(runner.vocab_size, [3], seed=3)[0]
    step = make_step(2, [Sched(1, 8, 3, [0, 1, 5], new_tokens=second)], freed=[0])
    logits, _ = runner.forward(step)
    torch.testing.assert_close(logits[0], hf_logits(hf, second)[-1], atol=ATOL, rtol=0)


def test_freed_slot_is_reused_cleanly(pair):
    runner, hf = pair
    runner.configure(configure(max_num_seqs=1))
    a, b = prompts(runner.vocab_size, [9, 5], seed=4)
    runner.forward(make_step(1, [Sched(0, 0, 9, [0, 1, 2], new_tokens=a)]))
    logits, _ = runner.forward(make_step(2, [Sched(0, 0, 5, [3, 4], new_tokens=b)], freed=[0]))
    torch.testing.assert_close(logits[0], hf_logits(hf, b)[-1], atol=ATOL, rtol=0)


def test_logprobs_of_a_step_survive_its_slot_being_reused_by_the_next_step(pair):
    """Step N+1 is submitted before step N is finished; when N+1 gives a finished request's
    slot to a request without logprobs, N's result still carries the first one's logprobs."""
    runner, _ = pair
    runner.configure(configure(max_num_seqs=1))
    a, b = prompts(runner.vocab_size, [6, 5], seed=5)
    wants = link_pb2.SamplingOptions(temperature=0, top_p=1, repetition_penalty=1, logprobs=3)
    first = runner.submit(make_step(1, [Sched(0, 0, 6, [0, 1], new_tokens=a, sampling=wants)]))
    runner.submit(make_step(2, [Sched(0, 0, 5, [2, 3], new_tokens=b)], freed=[0]))
    result = runner.finish(first)
    assert len(unpack_f32(result.sampled_logprobs)) == 1
    assert len(unpack_i32(result.top_token_ids)) == 3


def test_reconfigure_unbinds_the_old_kv_cache_before_sizing_the_new(pair, monkeypatch):
    """On CUDA the budget is what is allocated before and during a profiling step: a layer still
    holding a view of the old cache kept it allocated until that step rebound the layer, which
    shrank the measured peak (on the H200 a re-attach got ~2.3 GB more KV cache than its
    budget)."""
    runner, _ = pair
    runner.configure(configure())
    budget, seen = runner._kv_budget, []

    def measured(limits):
        seen.append([layer.k_cache.numel() + layer.v_cache.numel()
                     for layer in runner.model.attention_layers()])
        return budget(limits)

    monkeypatch.setattr(runner, "_kv_budget", measured)
    runner.configure(configure())
    assert seen == [[0] * len(runner.model.attention_layers())]

