"""Sampling from softmax(logits / T) by inverse transform: one uniform u per row, and the token
where the row's cumulative probability first exceeds u. Rows with T == 0 take the plain argmax.
No softmax tensor, no float32 copy of the logits, no noise per token.

Two launches. The first cuts each row into CHUNK-token chunks, one program each (a small batch
fills the device too), and reads its chunk once: the chunk's largest tempered logit, its argmax
and its mass sum(exp(x / T - max)). The second, one program a row, weighs the chunks' masses
against the row's largest logit, draws u from Philox keyed by the row's seed, finds the chunk
the draw falls in and, re-reading only that chunk, the token within it. So a row's token depends
only on its logits and its seed, never on the batch around it; the chunk size changes a draw
only where u falls within float32 rounding of a boundary between two tokens' shares.

Why not Gumbel-max (this file's predecessor, 1407ab9 to 1f5cb14): argmax(x / T + g) needs a
noise value g per token, and its Philox rounds, not the read, were the cost: 58 us of a 69 us
draw at 256 rows of a 151,936-token vocabulary on the H200 (profile-256-2769bc6.log), against
~19 us to read those bf16 logits once. Here a token costs one load and one exp2: 31.6 us at 256
rows, 17.3 at 128, 8.2 at 32 and 5.6 at 1 (bench/sampler_probe.py, sampler-890cda3.json: 8192-
token chunks and 4 warps, the best at 32-256 rows; 2048-token chunks gain 0.5 us at 1-8 rows).

Ties go to the lowest token id for greedy rows, as with torch.argmax.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.sizes import next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tempered(row_ptr, cols, vocab, temperature):
    """The chunk's logits over T in log2 units (-inf past the vocabulary); T == 0: as they are
    (a greedy row takes the argmax, which a scaling could turn into a tie of neighbours)."""
    scale = tl.where(temperature == 0.0, 1.0, LOG2E / temperature)
    x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    return x * scale


@triton.jit
def _chunk_kernel(logits_ptr, temperature_ptr, max_ptr, mass_ptr, arg_ptr, vocab, stride_row,
                  num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _tempered(logits_ptr + row.to(tl.int64) * stride_row, cols, vocab,
                  tl.load(temperature_ptr + row))
    top, arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    ref = tl.where(top == float("-inf"), 0.0, top)  # a chunk past the vocabulary: no -inf - -inf
    at = row * num_chunks + chunk
    tl.store(max_ptr + at, top)
    tl.store(mass_ptr + at, tl.sum(tl.exp2(x - ref), axis=0))
    tl.store(arg_ptr + at, chunk * CHUNK + arg)


@triton.jit(do_not_specialize=["base_seed"])
def _pick_kernel(logits_ptr, temperature_ptr, seeds_ptr, max_ptr, mass_ptr, arg_ptr, out_ptr,
                 vocab, stride_row, base_seed, num_chunks, HAS_ROW_SEEDS: tl.constexpr,
                 CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    lanes = tl.arange(0, CHUNKS)
    tops = tl.load(max_ptr + row * num_chunks + lanes, mask=lanes < num_chunks,
                   other=float("-inf"))
    top = tl.max(tops, axis=0)
    if temperature == 0.0:  # greedy: the first chunk holding the row's maximum, its argmax
        first = tl.min(tl.where(tops == top, lanes, CHUNKS), axis=0)
        token = tl.load(arg_ptr + row * num_chunks + first)
    else:
        token = _draw(logits_ptr + row.to(tl.int64) * stride_row, seeds_ptr, max_ptr, mass_ptr,
                      row, lanes, tops, top, temperature, vocab, base_seed, num_chunks,
                      HAS_ROW_SEEDS, CHUNK)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _draw(row_ptr, seeds_ptr, max_ptr, mass_ptr, row, lanes, tops, top, temperature, vocab,
          base_seed, num_chunks, HAS_ROW_SEEDS: tl.constexpr, CHUNK: tl.constexpr):
    """The token of a non-greedy row: the chunk its uniform draw falls in, then the token."""
    masses = tl.load(mass_ptr + row * num_chunks + lanes, mask=lanes < num_chunks, other=0.0)
    top_ref = tl.where(top == float("-inf"), 0.0, top)
    weights = masses * tl.exp2(tops - top_ref)
    weights = tl.where(tops == float("-inf"), 0.0, weights)  # [CHUNKS], the row's shares
    if HAS_ROW_SEEDS:
        seed = tl.load(seeds_ptr + row)
    else:
        seed = base_seed + row
    u = tl.sum(tl.rand(seed, tl.zeros([1], tl.int32)), axis=0)  # [0, 1)
    target = u * tl.sum(weights, axis=0)
    ends = tl.cumsum(weights, axis=0)
    # the chunk the draw falls in (rounding may push it past the last one with any mass)
    last = tl.max(tl.where(weights > 0.0, lanes, 0), axis=0)
    chunk = tl.minimum(tl.sum((ends <= target).to(tl.int32), axis=0), last)
    before = tl.sum(tl.where(lanes < chunk, weights, 0.0), axis=0)
    chunk_top = tl.load(max_ptr + row * num_chunks + chunk)
    # the draw in the chunk's own units (its mass relative to its own maximum); rounding can
    # put it below 0, before a zero-mass token
    inside = tl.maximum((target - before) * tl.exp2(top_ref - chunk_top), 0.0)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _tempered(row_ptr, cols, vocab, temperature)
    e = tl.exp2(x - chunk_top)
    last_token = tl.max(tl.where(e > 0.0, tl.arange(0, CHUNK), 0), axis=0)
    index = tl.minimum(tl.sum((tl.cumsum(e, axis=0) <= inside).to(tl.int32), axis=0), last_token)
    return chunk * CHUNK + index


def categorical_sample(logits: torch.Tensor, temperature: torch.Tensor, base_seed: int,
                       row_seeds: torch.Tensor | None = None, chunk: int = 8192,
                       num_warps: int = 4) -> torch.Tensor:
    """logits: [rows, vocab] (unit stride along vocab); temperature: [rows] float32 (any
    stride), 0 = greedy; row seeds: [rows] int64 on the device, else row r uses base_seed + r.
    `chunk`: tokens of a row per program of the first launch, a power of two >= 1024; it and
    num_warps are for tuning (bench/sampler_probe.py). Returns the sampled token ids, [rows]
    int64."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == (rows,)
    assert temperature.dtype == torch.float32
    assert row_seeds is None or (row_seeds.shape == (rows,) and row_seeds.dtype == torch.int64)
    assert chunk & (chunk - 1) == 0 and chunk >= 1024
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunk = min(chunk, max(1024, next_power_of_2(vocab)))
    num_chunks = -(-vocab // chunk)
    f32 = dict(dtype=torch.float32, device=logits.device)
    tops, masses = torch.empty(rows, num_chunks, **f32), torch.empty(rows, num_chunks, **f32)
    args = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    # contiguous: a strided column read in place would be another kernel variant (Triton
    # specializes a stride of 1), compiled inside the first served step, not at configure
    temperature = temperature.contiguous()
    _chunk_kernel[(rows, num_chunks)](logits, temperature, tops, masses, args, vocab,
                                      logits.stride(0), num_chunks, CHUNK=chunk,
                                      num_warps=num_warps)
    _pick_kernel[(rows,)](
        logits, temperature, row_seeds if row_seeds is not None else temperature, tops, masses,
        args, out, vocab, logits.stride(0), base_seed % (1 << 62), num_chunks,
        HAS_ROW_SEEDS=row_seeds is not None, CHUNK=chunk,
        CHUNKS=max(2, next_power_of_2(num_chunks)), num_warps=8)
    return out


def categorical_sample_ref(logits: torch.Tensor, temperature: torch.Tensor,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """The same draw with torch (equal in distribution, not in the values drawn)."""
    x = logits.float()
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    probs = torch.softmax(x / t, dim=-1).cpu()
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(x.device)
    return torch.where(greedy, x.argmax(dim=-1), drawn)
