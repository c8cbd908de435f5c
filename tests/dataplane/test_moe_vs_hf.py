"""Qwen3-MoE: the data plane's logits against transformers' Qwen3MoeForCausalLM, float32, on
seeded random checkpoints (both expert layouts, renormalized top-k or not, dense layers by
mlp_only_layers and by decoder_sparse_step); configs of transformers 4.x and 5.x; the experts'
CPU path against a per-token loop; the benchmark checkpoint writer."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HfMoeBlock

from dataplane.checkpoints import TinyQwen3Moe, write_large_random_qwen3_moe
from dataplane.layers.fused_moe import moe_reference, select_experts
from dataplane.loader import load_config
from dataplane.model_runner import ModelRunner, RunnerConfig
from dataplane.models.qwen3 import rope_theta
from dataplane.models.qwen3_moe import Qwen3MoeSparseMoeBlock
# The dense model's scenarios (a prefill batch, chunked prefill mixed with decodes, a prefill over
# cached blocks, a reused slot), collected again here: they take this module's `pair` fixture.
from tests.dataplane.test_model_vs_hf import (  # noqa: F401
    BLOCK, hf_logits, prompts, test_chunked_prefill_then_decode_matches,
    test_freed_slot_is_reused_cleanly, test_prefill_batch_matches,
    test_prefill_over_cached_blocks_matches)
from tests.dataplane.steps import Sched, configure, make_step

ATOL = 2e-4


def load_pair(path):
    runner = ModelRunner.load(RunnerConfig(model_dir=path, block_size=BLOCK, num_kv_blocks=128))
    hf = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return runner, hf


@pytest.fixture(scope="module", params=["moe", "moe_step2"])
def pair(request, moe_checkpoints):
    return load_pair(moe_checkpoints[request.param])


def test_sparse_layers_follow_the_config(pair):
    runner, hf = pair
    ours = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in runner.model.model.layers]
    assert ours == [isinstance(layer.mlp, HfMoeBlock) for layer in hf.model.layers]
    assert 0 < sum(ours) < len(ours)  # the checkpoints mix sparse and dense layers


def test_moe_block_matches_transformers(pair):
    """Router and experts alone, on more tokens than the model tests route."""
    runner, hf = pair
    sparse = [i for i, layer in enumerate(hf.model.layers) if isinstance(layer.mlp, HfMoeBlock)]
    hidden = torch.randn(57, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i in sparse:
            expected = hf.model.layers[i].mlp(hidden.unsqueeze(0))[0]
            got = runner.model.model.layers[i].mlp(hidden)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_moe_reference_equals_a_per_token_loop():
    """The CPU path (grouped by expert) against the definition, with experts that get no token."""
    g = torch.Generator().manual_seed(0)
    num_tokens, hidden, inter, num_experts, top_k = 9, 16, 8, 6, 2
    x = torch.randn(num_tokens, hidden, generator=g)
    # Weights scaled by their fan-in, as a layer's are: the values stay O(1), so float32's
    # rounding stays under the default tolerance. (Unscaled, outputs reached ~100 and the two
    # summation orders differed by 1.1e-5 on an AVX-512 machine's MKL kernels.)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, [1, 4]] = -1e9  # experts 1 and 4 receive no token
    weights, ids = select_experts(logits, top_k, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens))
    expected = torch.zeros(num_tokens, hidden)
    for t in range(num_tokens):
        for k in range(top_k):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            expected[t] += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(moe_reference(x, w13, w2, weights, ids), expected)


def write_transformers4_config(path) -> None:
    """Rewrite config.json as transformers 4.x wrote it (and the hub has it): num_experts,
    rope_theta at the top, torch_dtype. rope_theta is changed so reading it is observable."""
    config = json.loads((path / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    config.pop("rope_parameters")
    config["rope_theta"] = 1_000_000.0
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.51.0"
    (path / "config.json").write_text(json.dumps(config))


def test_transformers4_config_loads(moe_checkpoints, tmp_path):
    path = shutil.copytree(moe_checkpoints["moe"], tmp_path / "v4")
    write_transformers4_config(path)
    config = load_config(path)
    assert (config.num_experts, rope_theta(config), config.mlp_only_layers) == (8, 1e6, [1])
    runner, hf = load_pair(path)
    runner.configure(configure())
    p = prompts(runner.vocab_size, [11], seed=5)[0]
    logits, _ = runner.forward(make_step(1, [Sched(0, 0, 11, [0, 1, 2], new_tokens=p)]))
    torch.testing.assert_close(logits[0], hf_logits(hf, p)[-1], atol=ATOL, rtol=0)


def test_missing_expert_weight_fails_loudly(moe_checkpoints, tmp_path):
    path = shutil.copytree(moe_checkpoints["moe"], tmp_path / "partial")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    missing = r"model\.layers\.2\.mlp\.experts: \['experts\.5\.up_proj'"
    with pytest.raises(ValueError, match=missing):
        ModelRunner.load(RunnerConfig(model_dir=path))


def test_large_checkpoint_writer_output_loads(tmp_path):
    """The benchmark writer (hub layout in several shards, never holding the model) on a tiny
    spec: transformers reads it, and so do we, to the same logits."""
    spec = TinyQwen3Moe(mlp_only_layers=(0,), tie_word_embeddings=True)
    path = write_large_random_qwen3_moe(tmp_path / "large", spec, init_std=0.2,
                                        dtype=torch.float32, shard_bytes=100_000)
    assert len(list(path.glob("*.safetensors"))) > 1
    runner, hf = load_pair(path)
    runner.configure(configure())
    p = prompts(runner.vocab_size, [9], seed=6)[0]
    logits, _ = runner.forward(make_step(1, [Sched(0, 0, 9, [0, 1, 2], new_tokens=p)]))
    torch.testing.assert_close(logits[0], hf_logits(hf, p)[-1], atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["moe", "moe_step2"])
def test_cuda_model_with_fused_experts_matches_transformers(moe_checkpoints, name):
    """On CUDA the experts run as the fused Triton kernel (float32: IEEE dots); attention stays
    the torch backend so that only the MoE path differs from the CPU tests."""
    path = moe_checkpoints[name]
    runner = ModelRunner.load(RunnerConfig(model_dir=path, device="cuda", block_size=BLOCK,
                                           num_kv_blocks=128, attention_backend="torch"))
    hf = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    runner.configure(configure())
    ps = prompts(runner.vocab_size, [7, 1, 13, 40], seed=7)
    scheds, next_block = [], 0
    for slot, p in enumerate(ps):
        blocks = list(range(next_block, next_block + -(-len(p) // BLOCK)))
        next_block += len(blocks)
        scheds.append(Sched(slot, 0, len(p), blocks, new_tokens=p))
    logits, _ = runner.forward(make_step(1, scheds))
    for i, p in enumerate(ps):
        torch.testing.assert_close(logits[i].cpu(), hf_logits(hf, p)[-1], atol=1e-3, rtol=0)
