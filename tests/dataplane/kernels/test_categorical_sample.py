"""The fused inverse-transform sampler: greedy rows equal torch.argmax (ties to the lowest id), a
seeded row's token depends only on its logits and seed, and draws follow softmax(logits / T) as
the torch reference's do, across chunk boundaries too."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.categorical_sample import categorical_sample, categorical_sample_ref  # noqa: E402
from dataplane.sampler import SamplingBatch, Uses, fused_draw  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    KERNEL_MARKS, on_gpu, randn, skip_unsupported)

pytestmark = KERNEL_MARKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 5000, 151936])
def test_greedy_rows_are_the_argmax_with_ties_to_the_lowest_id(dtype, vocab, device, gen):
    skip_unsupported(dtype, device)
    if vocab > 10000 and not on_gpu(device):
        pytest.skip("a full vocabulary is slow under the interpreter")
    rows = 5
    logits = randn(rows, vocab, dtype=dtype, device=device, gen=gen, scale=3.0)
    logits[1, vocab // 2] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie across blocks
    logits[2, :] = 0.5  # all tied
    zeros = torch.zeros(rows, device=device)
    got = categorical_sample(logits, zeros, base_seed=1, chunk=2048)  # ties across chunks
    assert got.tolist() == logits.float().argmax(dim=-1).tolist()


def test_greedy_float32_neighbours_are_told_apart(device):
    """Two float32 logits one ulp apart: a greedy row takes the larger (scaling them into
    log2 units first could round them into a tie that goes to the lower id)."""
    x = torch.full((1, 50), -20.0)
    x[0, 0] = -7.8722067
    x[0, 1] = torch.nextafter(x[0, 0], torch.tensor(0.0))
    got = categorical_sample(x.to(device), torch.zeros(1, device=device), base_seed=1)
    assert got.tolist() == [1]


def test_a_seeded_row_depends_on_its_logits_and_seed_only(device, gen):
    vocab = 300
    logits = randn(6, vocab, dtype=torch.float32, device=device, gen=gen)
    logits[3] = logits[0]
    t = torch.full((6,), 0.8, device=device)
    seeds = torch.tensor([11, 12, 13, 11, 14, 15], device=device)
    first = categorical_sample(logits, t, base_seed=5, row_seeds=seeds)
    again = categorical_sample(logits[[3, 0]], t[:2], base_seed=999, row_seeds=seeds[[3, 0]])
    assert first[0] == first[3] == again[0] == again[1]
    # nor on how the kernel cuts the row (but for a draw within float32 rounding of the
    # boundary between two tokens' shares, which these rows do not meet)
    wide = randn(3, 5000, dtype=torch.float32, device=device, gen=gen)
    assert categorical_sample(wide, t[:3], base_seed=5, row_seeds=seeds[:3], chunk=2048).tolist() \
        == categorical_sample(wide, t[:3], base_seed=5, row_seeds=seeds[:3], chunk=8192).tolist()
    # unseeded rows change with the step's key
    draws = {tuple(categorical_sample(logits, t, base_seed=s).tolist()) for s in range(5)}
    assert len(draws) > 1


def test_draws_follow_softmax_of_logits_over_temperature(device, gen):
    rows, vocab, temperature = 4000 if on_gpu(device) else 1500, 6, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    logits = base.repeat(rows, 1).to(device)
    t = torch.full((rows,), temperature, device=device)
    got = torch.bincount(categorical_sample(logits, t, base_seed=1234).cpu(), minlength=vocab)
    ref = torch.bincount(categorical_sample_ref(logits, t, gen).cpu(), minlength=vocab)
    expected = torch.softmax(base / temperature, dim=0)
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert got[-1] == 0 and ref[-1] == 0  # a masked token is never drawn
    assert ((got / rows - expected).abs() <= 4 * sigma + 1e-9).all(), (got / rows, expected)
    assert ((ref / rows - expected).abs() <= 4 * sigma + 1e-9).all(), (ref / rows, expected)


def test_draws_follow_softmax_across_chunks(device, gen):
    """The mass spread over three 1024-token chunks (the chunks' edges among the tokens): the
    draw picks the chunk, then the token in it, each in proportion."""
    rows, vocab, temperature = 4000 if on_gpu(device) else 1500, 3000, 1.3
    ids = torch.tensor([5, 1023, 1024, 2047, 2999])
    values = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5])
    logits = torch.full((rows, vocab), float("-inf"))
    logits[:, ids] = values
    t = torch.full((rows,), temperature, device=device)
    got = categorical_sample(logits.to(device), t, base_seed=77, chunk=1024).cpu()
    counts = torch.bincount(got, minlength=vocab)
    expected = torch.softmax(values / temperature, dim=0)
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert counts.sum() == counts[ids].sum() == rows  # nothing outside the five
    assert ((counts[ids] / rows - expected).abs() <= 4 * sigma).all(), (counts[ids] / rows, expected)


def test_mixed_greedy_and_sampled_rows_of_a_strided_temperature(device, gen):
    logits = randn(4, 50, dtype=torch.float32, device=device, gen=gen, scale=4.0)
    params = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1e-4, 1.0]], device=device)
    got = categorical_sample(logits, params[:, 0], base_seed=3)
    argmax = logits.argmax(dim=-1)
    assert got[0] == argmax[0] and got[2] == argmax[2]
    assert got[3] == argmax[3]  # a tiny temperature is as good as greedy at this scale


def test_a_seeded_row_ignores_a_truncating_batch_mate(device, gen):
    """With a top-p neighbour the batch truncates first; the seeded row's token stays the same,
    and a greedy row stays the argmax."""
    logits = randn(3, 100, dtype=torch.float32, device=device, gen=gen)

    def batch(top_p):
        ones = torch.ones(3, device=device)
        return SamplingBatch(
            temperature=torch.tensor([0.8, 0.8, 0.0], device=device),
            top_k=torch.zeros(3, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, device=device), min_p=ones * 0,
            presence_penalty=ones * 0, frequency_penalty=ones * 0, repetition_penalty=ones,
            seeds=[7, None, None], output_index=[3, 0, 0], output_counts=None,
            prompt_mask=None, suppress_mask=None, max_logprobs=-1,
            uses=Uses(top_k=False, top_p=min(top_p) < 1, min_p=False))
    alone = fused_draw(logits, batch([1.0, 1.0, 1.0]))
    mixed = fused_draw(logits, batch([1.0, 0.5, 1.0]))
    assert alone[0] == mixed[0]
    assert alone[2] == mixed[2] == logits.argmax(dim=-1)[2]
