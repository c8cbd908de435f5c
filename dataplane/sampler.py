"""Batched sampling on rank 0: penalties, min_tokens, temperature, top-k, top-p, min-p, seeds and
logprobs, vectorized over the batch (the only per-row loop draws noise for seeded rows).

Which transformations run is decided from host-side flags (`SamplingBatch.uses`), computed from
the per-request parameters the data plane keeps on the CPU, so sampling never waits for the
device to answer a question like "does any row use top-k?".

Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p. A seeded row
draws its q from a generator seeded by (seed, output index), so its tokens depend on its own seed
and logits only, not on the rest of the batch, nor on how many times it was recomputed.

On CUDA the draw is a fused kernel over the logits instead (dataplane.kernels.categorical_sample:
inverse transform sampling, one Philox uniform per row keyed by the same (seed, output index)),
for every batch, so a seeded row's tokens never depend on its batch-mates; when no row
truncates (top-k, top-p, min-p) it reads the model's logits directly, the largest tensor of the
step, which the torch path passes over about ten times. The same seed gives different tokens on
CPU and on CUDA.
"""

import random
from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # SplitMix64's increment, 2^64 over the golden ratio
_MASK_64 = (1 << 64) - 1


@dataclass(frozen=True)
class Uses:
    """Which transformations any row needs (host-side, so no device sync decides it)."""

    all_greedy: bool = False
    top_k: bool = True
    top_p: bool = True
    min_p: bool = True

    @classmethod
    def of(cls, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor) -> "Uses":
        """From CPU tensors of the rows' parameters."""
        return cls(all_greedy=bool((temperature == 0).all()), top_k=bool((top_k > 0).any()),
                   top_p=bool((top_p < 1).any()), min_p=bool((min_p > 0).any()))


@dataclass
class SamplingBatch:
    """Per-row parameters of the rows being sampled, on the logits' device."""

    temperature: torch.Tensor  # [rows] float32; 0 = greedy
    top_k: torch.Tensor  # [rows] whole numbers (the slot table's float32 column); 0 = off
    top_p: torch.Tensor  # [rows] float32; 1 = off
    min_p: torch.Tensor  # [rows] float32; 0 = off
    presence_penalty: torch.Tensor  # [rows] float32
    frequency_penalty: torch.Tensor  # [rows] float32
    repetition_penalty: torch.Tensor  # [rows] float32; 1 = off
    seeds: list[int | None]  # per row; may be empty when no row is seeded
    output_index: list[int]  # per row: how many output tokens the row has already (with seeds)
    # Penalties: [rows, vocab] counts of each token among the outputs, and a prompt-presence mask;
    # None when no row has a penalty.
    output_counts: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    # min_tokens: [rows, vocab] True where a token must not be sampled yet; None when no row needs it.
    suppress_mask: torch.Tensor | None
    max_logprobs: int  # the largest N asked for among the rows; -1 when none asked
    uses: Uses = Uses()  # the default checks everything (correct, and fine for tests)

    @classmethod
    def same_for_all(cls, rows: int, device: torch.device, *, temperature: float = 1.0,
                     top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                     penalty: float = 0.0, repetition_penalty: float = 1.0,
                     seed: int | None = None, max_logprobs: int = -1,
                     uses: Uses = Uses()) -> "SamplingBatch":
        """Every row with the same parameters (warm-ups and memory profiling); `penalty` is
        both the presence and the frequency penalty."""
        full = lambda value: torch.full((rows,), value, device=device)  # noqa: E731
        return cls(temperature=full(float(temperature)), top_k=full(top_k),
                   top_p=full(float(top_p)), min_p=full(float(min_p)),
                   presence_penalty=full(float(penalty)),
                   frequency_penalty=full(float(penalty)),
                   repetition_penalty=full(float(repetition_penalty)), seeds=[seed] * rows,
                   output_index=[0] * rows, output_counts=None, prompt_mask=None,
                   suppress_mask=None, max_logprobs=max_logprobs, uses=uses)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32: logprob of the sampled token
    top_token_ids: torch.Tensor | None  # [rows, max_logprobs] int64
    top_logprobs: torch.Tensor | None  # [rows, max_logprobs] float32


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits: [rows, vocab]. Logprobs come from the unmodified model distribution."""
    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if batch.max_logprobs >= 0 else None
    if batch.output_counts is not None:
        logits = apply_penalties(logits.float(), batch)
    if batch.suppress_mask is not None:
        logits = logits.masked_fill(batch.suppress_mask, float("-inf"))
    token_ids = _choose(logits, batch)
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    top_logprobs, top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return SamplerOutput(token_ids, sampled, top_ids, top_logprobs)


# Finite after division by the smallest temperature (0.01, controlplane/validation.py).
_MAX_PENALIZED_LOGIT = 1e30


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (divide positive logits, multiply negative
    ones); presence and frequency penalties over output tokens, as in vLLM and OpenAI."""
    if batch.output_counts is None:
        return logits
    counts = batch.output_counts
    seen = (counts > 0) | batch.prompt_mask
    penalty = batch.repetition_penalty.unsqueeze(1).expand_as(logits)
    # a penalty near 0 or near float32's largest takes a logit to +-inf, a NaN after softmax
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(
        -_MAX_PENALIZED_LOGIT, _MAX_PENALIZED_LOGIT)
    logits = torch.where(seen, scaled, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    return logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def _choose(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.uses.all_greedy:
        return logits.argmax(dim=-1)
    if logits.is_cuda:
        return fused_draw(logits, batch)
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    is_greedy = batch.temperature == 0
    probs = sampling_probs(logits, batch)
    random = (probs / _exponential_noise(probs, batch)).argmax(dim=-1)
    return torch.where(is_greedy, greedy, random)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, then min-p, top-k and top-p
    truncation (_truncate). Greedy rows (temperature 0) get temperature 1 here and are not
    sampled."""
    is_greedy = batch.temperature == 0
    temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
    return torch.softmax(_truncate(logits / temperature.unsqueeze(1), batch), dim=-1)


def _truncate(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM V1's truncation, in its order: tokens below min_p * the top probability go; then all
    but the tokens at least as likely as the top_k-th (tokens tied with it stay); then the least
    likely tokens whose mass is at most 1 - top_p, summed from the bottom (so that a row at
    top_p 1 loses nothing, whatever its batch-mates ask: a sum from the top rounds to 1 before
    the tail, which it cut)."""
    if batch.uses.min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (batch.uses.top_k or batch.uses.top_p):
        return logits
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)  # [rows, vocab]
    if batch.uses.top_k:
        k = torch.where(batch.top_k > 0, batch.top_k, vocab).clamp(max=vocab).long()
        kth = ascending.gather(1, (vocab - k).unsqueeze(1))  # [rows, 1]
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    if batch.uses.top_p:
        mass_up_to = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
        drop = mass_up_to <= 1 - batch.top_p.unsqueeze(1)
        drop[:, -1] = False  # the most likely token stays
        ascending = ascending.masked_fill(drop, float("-inf"))
    return ascending.scatter(1, order, ascending)


_STEP_SEEDS = random.Random()  # unseeded rows: a fresh key per step


def fused_draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The tokens of a batch that is not all greedy, with the fused kernel (what CUDA uses)."""
    from dataplane.kernels.categorical_sample import categorical_sample  # CUDA: imports triton
    temperature = batch.temperature
    uses = batch.uses
    if uses.top_k or uses.top_p or uses.min_p:
        # Truncate the tempered logits (as sampling_probs does) and draw from them at
        # temperature 1; a greedy row keeps its argmax through any truncation.
        is_greedy = temperature == 0
        logits = _truncate(logits.float() / torch.where(is_greedy, 1.0, temperature)[:, None],
                           batch)
        temperature = (~is_greedy).float()
    base = _STEP_SEEDS.getrandbits(62)
    row_seeds = None
    if any(seed is not None for seed in batch.seeds):
        row_seeds = torch.tensor(
            [base + row if seed is None else _seed_key(seed, batch.output_index[row])
             for row, seed in enumerate(batch.seeds)], dtype=torch.int64
        ).to(logits.device, non_blocking=True)
    return categorical_sample(logits, temperature, base, row_seeds)


def compile_kernels(logits: torch.Tensor) -> None:
    """Compile the fused draw for a step's logits (their dtype and vocabulary) and for float32
    ones (after penalties or truncation), seeded and not."""
    no_truncation = Uses(top_k=False, top_p=False, min_p=False)
    for x in (logits, logits.float()):
        for seed in (None, 0):
            fused_draw(x, SamplingBatch.same_for_all(x.shape[0], x.device, seed=seed,
                                                     uses=no_truncation))


def _seed_key(seed: int, output_index: int) -> int:
    """The generator's key (63 bits, as torch and Philox take it) for a request's uint64 seed at
    one output token. All 64 bits of the seed are mixed before the top one is dropped: a plain
    product modulo 2^63 gave seeds 2^63 apart the same tokens."""
    return _mix64((_mix64(seed) + output_index) & _MASK_64) >> 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection on 64 bits in which every input bit moves about half
    of the output bits."""
    x = (x + _SEED_MIX) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, seed in enumerate(batch.seeds):
        if seed is not None:
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(_seed_key(seed, batch.output_index[row]))
            noise[row].exponential_(generator=generator)
    return noise
