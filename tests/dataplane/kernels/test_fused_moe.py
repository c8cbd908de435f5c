"""The fused MoE kernels against their references: `align` against `align_reference`, and
`fused_moe` against the CPU path `moe_reference` computed in float32 from the same weights.

On CUDA (`-m gpu`); on CPU under Triton's interpreter with TRITON_INTERPRET=1 (small shapes
only, and no bfloat16: the interpreter's tl.dot reads bfloat16 bits as integers).

Tolerances, relative to the largest output: float32 1e-5 (IEEE dots); float16/bfloat16 2e-2 max
and 4e-3 RMS, the kernel rounding the activations and each pair's output to the input dtype
(observed on float16: ~1e-3 max).
"""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
pytest.importorskip("triton")

from dataplane.kernels.fused_moe import (_CONFIGS, align, align_reference,  # noqa: E402
                                         fused_moe)
from dataplane.layers.fused_moe import moe_reference, select_experts  # noqa: E402

# Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, moe_intermediate 768 (384 a rank at TP=2)
QWEN3_30B = dict(hidden=2048, inter=768, num_experts=128, top_k=8)
# small, odd sizes: hidden not a multiple of BLOCK_K, intermediate not of BLOCK_N
SMALL = dict(hidden=96, inter=48, num_experts=8, top_k=2)
TINY = dict(hidden=64, inter=32, num_experts=16, top_k=4)


def routing(num_tokens: int, num_experts: int, top_k: int, unused: list[int], seed: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing (renormalized softmax) that never picks the `unused` experts."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, unused] = float("-inf")
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return weights.to(device), ids.to(device)


def problem(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
            dtype: torch.dtype, device: torch.device, seed: int = 0, unused: list[int] = ()):
    g = torch.Generator(device).manual_seed(seed)  # on the device: Qwen3-30B's experts are big
    x = torch.randn(num_tokens, hidden, generator=g, device=device)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) / inter ** 0.5
    weights, ids = routing(num_tokens, num_experts, top_k, list(unused), seed, device)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


def check(x, w13, w2, weights, ids, **kwargs) -> None:
    out = fused_moe(x, w13, w2, weights, ids, **kwargs)
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    error = (out.float() - expected).abs()
    scale = expected.abs().max().item()
    if x.dtype == torch.float32:
        assert error.max().item() <= 1e-5 * scale, (error.max().item(), scale)
    else:
        rms = error.pow(2).mean().sqrt().item()
        assert error.max().item() <= 2e-2 * scale and rms <= 4e-3 * scale, (error.max(), rms, scale)


def dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
@pytest.mark.parametrize("num_experts,top_k,block_m", [(8, 2, 16), (16, 4, 16), (128, 8, 64),
                                                       (6, 4, 32)])
def test_align_matches_reference(device, num_tokens, num_experts, top_k, block_m):
    """Each expert's run, sorted (the kernel's order within a run is arbitrary; padding, equal to
    num_pairs, sorts last), equals the reference; tiles name their experts; idle experts get
    none."""
    _, ids = routing(num_tokens, num_experts, top_k, [1], seed=num_tokens, device=device)
    sorted_ids, block_expert_ids, num_padded = align(ids, num_experts, block_m)
    ref_ids, ref_experts, ref_padded = align_reference(ids, num_experts, block_m)
    assert int(num_padded.item()) == ref_padded
    assert block_expert_ids[:ref_padded // block_m].tolist() == ref_experts.tolist()
    got = sorted_ids[:ref_padded].cpu().clone()
    for expert in ref_experts.unique().tolist():
        run = (ref_experts == expert).nonzero().flatten()
        rows = slice(int(run[0]) * block_m, (int(run[-1]) + 1) * block_m)
        got[rows] = got[rows].sort().values
    assert got.tolist() == ref_ids.tolist()
    assert 1 not in ref_experts.tolist()


@pytest.mark.parametrize("dtype", dtypes(), ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 33])
@pytest.mark.parametrize("shape", [SMALL, TINY], ids=["small", "tiny"])
def test_small_shapes_match_reference(device, dtype, num_tokens, shape):
    check(*problem(num_tokens, **shape, dtype=dtype, device=device, unused=[1, 2]))


@pytest.mark.parametrize("config", [config for _, config in _CONFIGS],
                         ids=[f"tokens<={limit}" for limit, _ in _CONFIGS])
def test_every_table_config_matches_reference(device, config):
    """Each config of the table, whatever the token count picks (tiles clipped to the shape)."""
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    check(*problem(21, **SMALL, dtype=dtype, device=device, unused=[3]), config=config)


def test_int32_ids_and_no_tokens(device):
    x, w13, w2, weights, ids = problem(5, **TINY, dtype=torch.float32, device=device)
    check(x, w13, w2, weights, ids.to(torch.int32))
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, TINY["hidden"])


@pytest.mark.skipif(INTERPRET, reason="Qwen3-30B-A3B shapes are too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, 64, 100, 255, 512, 1000, 2048, 3000])
def test_qwen3_30b_shapes_match_reference(device, dtype, num_tokens):
    """Every token count of the config table; 13 of the 128 experts never routed to."""
    unused = list(range(0, 128, 10))
    check(*problem(num_tokens, **QWEN3_30B, dtype=dtype, device=device, seed=num_tokens,
                   unused=unused))


@pytest.mark.skipif(INTERPRET, reason="Qwen3-30B-A3B shapes are too slow for the interpreter")
@pytest.mark.parametrize("num_tokens", [1, 300, 4096])
def test_tp2_shard_shapes_match_reference(device, num_tokens):
    """A TP=2 rank's shard (intermediate 384) and one expert taking every token at top-1."""
    shape = dict(QWEN3_30B, inter=384)
    check(*problem(num_tokens, **shape, dtype=torch.bfloat16, device=device, seed=1))
    x, w13, w2, _, _ = problem(num_tokens, **shape, dtype=torch.bfloat16, device=device)
    ids = torch.full((num_tokens, 1), 7, dtype=torch.int64, device=device)
    check(x, w13, w2, torch.ones(num_tokens, 1, device=device), ids)
