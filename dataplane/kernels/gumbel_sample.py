"""Sampling from softmax(logits / T) in one pass over the logits, with the Gumbel-max trick:
argmax(logits / T + g), g standard Gumbel noise, is a draw from softmax(logits / T). Rows with
T == 0 take the plain argmax. No softmax, no float32 copy of the logits and no noise tensor:
each program reads its row once (bf16 or float32) and draws the noise from Philox counters
(row seed, token id), so a row's token depends only on its logits and its seed, never on the
batch around it.

Ties go to the lowest token id, as with torch.argmax.
"""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["base_seed"])
def _gumbel_sample_kernel(logits_ptr, temperature_ptr, seeds_ptr, out_ptr, vocab, stride_row,
                          base_seed, HAS_ROW_SEEDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperature_ptr + row)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    if HAS_ROW_SEEDS:
        seed = tl.load(seeds_ptr + row)
    else:
        seed = base_seed + row
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, cols)  # uniform in [0, 1); u == 0 gives -inf noise, never chosen
        noisy = x * inv_t - tl.log(-tl.log(u))
        score = tl.where(mask, tl.where(greedy, x, noisy), float("-inf"))
        value, index = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = value > best  # strictly: an earlier block keeps a tie
        best_id = tl.where(better, start + index, best_id)
        best = tl.where(better, value, best)
    tl.store(out_ptr + row, best_id.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, base_seed: int,
                  row_seeds: torch.Tensor | None = None, block: int = 4096) -> torch.Tensor:
    """logits: [rows, vocab] (unit stride along vocab); temperature: [rows] float32 (any
    stride), 0 = greedy; row seeds: [rows] int64 on the device, else row r uses base_seed + r.
    Returns the sampled token ids, [rows] int64."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == (rows,)
    assert temperature.dtype == torch.float32
    assert row_seeds is None or (row_seeds.shape == (rows,) and row_seeds.dtype == torch.int64)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    temperature = temperature.contiguous()
    _gumbel_sample_kernel[(rows,)](
        logits, temperature, row_seeds if row_seeds is not None else temperature, out, vocab,
        logits.stride(0), base_seed % (1 << 62), HAS_ROW_SEEDS=row_seeds is not None,
        BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8)
    return out


def gumbel_sample_ref(logits: torch.Tensor, temperature: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """The same draw with torch's noise (equal in distribution, not in the values drawn)."""
    x = logits.float()
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    u = torch.rand(x.shape, generator=generator, device="cpu").to(x.device)
    noisy = x / t - torch.log(-torch.log(u))
    return torch.where(greedy, x.argmax(dim=-1), noisy.argmax(dim=-1))
