"""The batched sampler against a plain per-row torch reference on fixed logits."""

from collections import Counter

import pytest
import torch

from dataplane.sampler import SamplingBatch, apply_penalties, sample, sampling_probs

VOCAB = 50


def make_batch(rows: list[dict], prompts=None, outputs=None) -> SamplingBatch:
    col = lambda key, default, dtype=torch.float32: torch.tensor(  # noqa: E731
        [r.get(key, default) for r in rows], dtype=dtype)
    batch = SamplingBatch(
        temperature=col("temperature", 1.0), top_k=col("top_k", 0, torch.int64),
        top_p=col("top_p", 1.0), min_p=col("min_p", 0.0),
        presence_penalty=col("presence", 0.0), frequency_penalty=col("frequency", 0.0),
        repetition_penalty=col("repetition", 1.0), seeds=[r.get("seed") for r in rows],
        output_index=[len(o) for o in outputs] if outputs else [0] * len(rows),
        output_counts=None, prompt_mask=None, suppress_mask=None, max_logprobs=-1)
    if prompts is not None:
        batch.output_counts = torch.zeros(len(rows), VOCAB)
        batch.prompt_mask = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
        for i, (p, o) in enumerate(zip(prompts, outputs)):
            batch.prompt_mask[i, p] = True
            for token, count in Counter(o).items():
                batch.output_counts[i, token] = count
    return batch


def reference_penalties(logits, row, prompt, output):
    logits = logits.clone()
    for token in set(prompt) | set(output):
        p = row.get("repetition", 1.0)
        logits[token] = logits[token] / p if logits[token] > 0 else logits[token] * p
    for token, count in Counter(output).items():
        logits[token] -= row.get("frequency", 0.0) * count + row.get("presence", 0.0)
    return logits


def reference_probs(logits, row):
    """vLLM V1's order: temperature; drop tokens below min_p * the top probability; keep every
    token at least as likely as the top_k-th (ties stay); then keep the smallest most-likely set
    whose mass reaches top_p."""
    probs = torch.softmax(logits.double() / row.get("temperature", 1.0), dim=-1)
    keep = probs >= row.get("min_p", 0.0) * probs.max()
    k = row.get("top_k", 0)
    if k > 0:
        kept_values = probs[keep].sort(descending=True).values
        keep &= probs >= kept_values[min(k, len(kept_values)) - 1]
    kept = probs * keep
    kept = kept / kept.sum()
    mass, nucleus = 0.0, []
    for token in kept.argsort(descending=True).tolist():
        if not keep[token]:
            break
        nucleus.append(token)
        mass += float(kept[token])
        if mass >= row.get("top_p", 1.0):
            break
    keep[:] = False
    keep[nucleus] = True
    kept = probs * keep
    return (kept / kept.sum()).float()


ROWS = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 0.9, "min_p": 0.2},
    {"temperature": 1.0, "top_k": 10, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 1},
]


def test_truncation_matches_reference():
    logits = torch.randn(len(ROWS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    probs = sampling_probs(logits, make_batch(ROWS))
    for i, row in enumerate(ROWS):
        torch.testing.assert_close(probs[i], reference_probs(logits[i], row), atol=1e-6, rtol=1e-5)


def test_min_p_cuts_before_top_p_as_in_vllm_v1():
    """min_p first, then top-p over what it left: {.5, .3, .15, .05} with min_p 0.2 keeps
    {.5, .3, .15}, whose top 0.82 of mass is {.5, .3} (top-p first kept .15 too)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = sampling_probs(logits, make_batch([{"min_p": 0.2, "top_p": 0.82}]))
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[0.0, 2.0, 2.0, 2.0, 1.0]] * 2)
    probs = sampling_probs(logits, make_batch([{"top_k": 1}, {"top_k": 2}]))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3, 0.0]] * 2))


def test_a_row_without_top_p_keeps_its_whole_distribution_beside_one_with_it():
    """The batch runs top-p when any row uses it; a row at top_p 1 must lose nothing then (a
    cumulative sum from the top rounded to 1 before the tail and cut it: a seeded row's tokens
    changed with its batch-mates)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 151_936, generator=g) * 2.5
    logits[0, :20] += 12  # peaked, as a language model's are
    alone = sampling_probs(logits, make_batch([{}]))
    beside = sampling_probs(logits.expand(2, -1), make_batch([{}, {"top_p": 0.9}]))
    assert bool((beside[0] > 0).all()) and torch.equal(beside[0], alone[0])


@pytest.mark.parametrize("row", [
    {"repetition": 1.3}, {"repetition": 0.7}, {"presence": 1.5}, {"frequency": 0.5},
    {"presence": -1.0, "frequency": -0.3, "repetition": 1.1}])
def test_penalties_match_reference(row):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=g) * 4
    prompt, output = [1, 2, 3, 3, 40], [3, 7, 7, 7, 9, 1]
    got = apply_penalties(logits, make_batch([row], [prompt], [output]))
    torch.testing.assert_close(got[0], reference_penalties(logits[0], row, prompt, output))


@pytest.mark.parametrize("repetition", [1e-39, 1e-45, 3e38])
@pytest.mark.parametrize("temperature", [1.0, 0.01])
def test_an_extreme_repetition_penalty_samples_from_finite_probabilities(repetition, temperature):
    """A denormal penalty took a seen token's positive logit to inf (and a huge one a negative
    logit to -inf): softmax gave NaN, and the sampler drew token 0."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    prompt = [t for t in range(VOCAB) if t % 3 == 0]
    row = {"repetition": repetition, "temperature": temperature, "seed": 5}
    batch = make_batch([row], [prompt], [[]])
    probs = sampling_probs(apply_penalties(logits, batch), batch)
    assert bool(torch.isfinite(probs).all()) and abs(float(probs.sum()) - 1) < 1e-5
    token = int(sample(logits, batch).token_ids[0])
    if repetition < 1:  # a seen token with a positive logit: they outweigh the rest by far
        assert token in prompt and float(logits[0, token]) > 0


def test_top_k_1_is_greedy_and_greedy_rows_stay_greedy():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    rows = [{"temperature": 1.5, "top_k": 1}] * 3 + [{"temperature": 0.0}] * 3
    assert sample(logits, make_batch(rows)).token_ids.tolist() == logits.argmax(-1).tolist()


def test_seeded_rows_ignore_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(3)
    target = torch.randn(1, VOCAB, generator=g)
    row = {"temperature": 1.0, "seed": 1234}
    alone = [sample(target, make_batch([row], [[0]], [[0] * n])).token_ids.item() for n in range(20)]
    for size in (2, 5):
        others = torch.randn(size - 1, VOCAB, generator=g)
        rows = [{"temperature": 0.8}] * (size - 1) + [row]
        batch_logits = torch.cat([others, target])
        got = [sample(batch_logits, make_batch(rows, [[0]] * size, [[0] * n] * size)).token_ids[-1].item()
               for n in range(20)]
        assert got == alone
    assert len(set(alone)) > 1, "a seeded row must still vary with the output index"


@pytest.mark.parametrize("seed", [0, 1234, 2**63 - 1])
def test_seeds_that_differ_in_the_top_bit_draw_differently(seed):
    """Every bit of the API's uint64 seed counts: seeds 2^63 apart are different streams."""
    logits = torch.zeros(1, VOCAB)  # uniform: 20 draws from two streams coincide by chance ~1e-34
    draws = [[sample(logits, make_batch([{"seed": s}], [[0]], [[0] * n])).token_ids.item()
              for n in range(20)] for s in (seed, seed + 2**63)]
    assert draws[0] != draws[1]


def test_sampling_follows_the_distribution():
    """Unseeded draws: empirical frequencies within 4 sigma of the target probabilities."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    row = {"temperature": 1.0, "top_k": 4}
    n = 4000
    batch = make_batch([row] * n)
    counts = torch.bincount(sample(logits.expand(n, -1), batch).token_ids, minlength=VOCAB).float()
    target = reference_probs(logits[0], row)
    sigma = (target * (1 - target) / n).sqrt()
    assert bool(((counts / n - target).abs() <= 4 * sigma + 1e-9).all())


def test_suppression_and_logprobs():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0
    batch = make_batch([{"temperature": 0.0}, {"temperature": 0.0}])
    batch.suppress_mask = torch.zeros(2, VOCAB, dtype=torch.bool)
    batch.suppress_mask[0, 7] = True
    batch.max_logprobs = 3
    out = sample(logits, batch)
    assert out.token_ids[1] == 7 and out.token_ids[0] != 7
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, raw[[0, 1], out.token_ids])
    assert out.top_token_ids[:, 0].tolist() == [7, 7]
