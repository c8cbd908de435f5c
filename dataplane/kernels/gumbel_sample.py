"""Sampling from softmax(logits / T) in one pass over the logits, with the Gumbel-max trick:
argmax(logits / T + g), g standard Gumbel noise, is a draw from softmax(logits / T). Rows with
T == 0 take the plain argmax. No softmax, no float32 copy of the logits and no noise tensor:
each program reads its piece of a row once (bf16 or float32) and draws the noise from Philox
counters keyed by the row's seed, so a row's token depends only on its logits and its seed,
never on the batch around it.

The noise, not the read, is the cost (about 60 integer ops of Philox per counter against 2 bytes
of logits), so each counter's four outputs serve four tokens, and a row is cut into chunks that
run as separate programs: a small batch fills the device too. A second kernel reduces each row's
chunk winners. Each lane of a program keeps its own running best over the chunk, and the lanes
are reduced once at the end (a reduction across the program's warps per 512 tokens had been a
fifth of the instructions). On the GPU the two logarithms of the noise use the hardware's
approximate log2 (relative error ~2^-22, far below the noise's own spread) instead of a
software polynomial of ~12 FMAs each. Measured on an H200 at 256 rows of a 151,936-token
vocabulary (bench/profile_decode.py): 233 us with one program per row and one Philox output per
token, 150 us with the chunks and shared counters, 58 us with the per-lane best and the
hardware log2.

Ties go to the lowest token id, as with torch.argmax.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _scores(row_ptr, u, first, vocab, inv_t, greedy, QUARTER: tl.constexpr,
            FAST_LOG: tl.constexpr):
    """Tokens first .. first + QUARTER - 1: their noisy scores (the logit for greedy rows, -inf
    past the vocabulary) and ids."""
    cols = first + tl.arange(0, QUARTER)
    mask = cols < vocab
    x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if FAST_LOG:  # -ln(-ln u) = -ln2 * log2(-ln2 * log2 u)
        noise = -LN2 * libdevice.fast_log2f(-LN2 * libdevice.fast_log2f(u))
    else:  # the interpreter has no libdevice
        noise = -tl.log(-tl.log(u))
    noisy = x * inv_t + noise  # u == 0: -inf noise, never chosen
    return tl.where(mask, tl.where(greedy, x, noisy), float("-inf")), cols


@triton.jit
def _keep_better(best, best_id, score, cols):
    """Per lane: a lane sees its tokens in increasing order, so strictly better keeps the lowest
    id of a tie."""
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_id)


@triton.jit(do_not_specialize=["base_seed"])
def _gumbel_chunk_kernel(logits_ptr, temperature_ptr, seeds_ptr, best_ptr, best_id_ptr, vocab,
                         stride_row, base_seed, num_chunks, HAS_ROW_SEEDS: tl.constexpr,
                         CHUNK: tl.constexpr, QUARTER: tl.constexpr, FAST_LOG: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.load(temperature_ptr + row)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    if HAS_ROW_SEEDS:
        seed = tl.load(seeds_ptr + row)
    else:
        seed = base_seed + row
    best = tl.full((QUARTER,), float("-inf"), tl.float32)
    best_id = tl.zeros((QUARTER,), tl.int32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    # Block `start` (4 * QUARTER tokens) uses Philox counters start / 4 + lane; output j of a
    # counter is the noise of token start + j * QUARTER + lane. (QUARTER is fixed: it is part
    # of which noise a token gets.)
    for start in range(chunk * CHUNK, (chunk + 1) * CHUNK, 4 * QUARTER):
        u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + tl.arange(0, QUARTER))
        score, cols = _scores(row_ptr, u0, start, vocab, inv_t, greedy, QUARTER, FAST_LOG)
        best, best_id = _keep_better(best, best_id, score, cols)
        score, cols = _scores(row_ptr, u1, start + QUARTER, vocab, inv_t, greedy, QUARTER,
                              FAST_LOG)
        best, best_id = _keep_better(best, best_id, score, cols)
        score, cols = _scores(row_ptr, u2, start + 2 * QUARTER, vocab, inv_t, greedy, QUARTER,
                              FAST_LOG)
        best, best_id = _keep_better(best, best_id, score, cols)
        score, cols = _scores(row_ptr, u3, start + 3 * QUARTER, vocab, inv_t, greedy, QUARTER,
                              FAST_LOG)
        best, best_id = _keep_better(best, best_id, score, cols)
    value = tl.max(best, axis=0)
    token = tl.min(tl.where(best == value, best_id, vocab), axis=0)  # the lowest id of a tie
    tl.store(best_ptr + row * num_chunks + chunk, value)
    tl.store(best_id_ptr + row * num_chunks + chunk, token)


@triton.jit
def _gumbel_reduce_kernel(best_ptr, best_id_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, CHUNKS)
    mask = lanes < num_chunks
    best = tl.load(best_ptr + row * num_chunks + lanes, mask=mask, other=float("-inf"))
    _, index = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(best_id_ptr + row * num_chunks + index)
    tl.store(out_ptr + row, token.to(tl.int64))


_QUARTER = 512  # a counter's four outputs go to tokens this far apart


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, base_seed: int,
                  row_seeds: torch.Tensor | None = None, chunk: int = 8192) -> torch.Tensor:
    """logits: [rows, vocab] (unit stride along vocab); temperature: [rows] float32 (any
    stride), 0 = greedy; row seeds: [rows] int64 on the device, else row r uses base_seed + r.
    `chunk`: tokens of a row per program, a power of two >= 2048 (the draws do not depend on
    it). Returns the sampled token ids, [rows] int64."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == (rows,)
    assert temperature.dtype == torch.float32
    assert row_seeds is None or (row_seeds.shape == (rows,) and row_seeds.dtype == torch.int64)
    assert chunk & (chunk - 1) == 0 and chunk >= 4 * _QUARTER
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunk = max(4 * _QUARTER, min(chunk, triton.next_power_of_2(vocab)))
    num_chunks = -(-vocab // chunk)
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    temperature = temperature.contiguous()
    _gumbel_chunk_kernel[(rows, num_chunks)](
        logits, temperature, row_seeds if row_seeds is not None else temperature, best, best_id,
        vocab, logits.stride(0), base_seed % (1 << 62), num_chunks,
        HAS_ROW_SEEDS=row_seeds is not None, CHUNK=chunk, QUARTER=_QUARTER,
        FAST_LOG=logits.device.type == "cuda", num_warps=4)
    _gumbel_reduce_kernel[(rows,)](best, best_id, out, num_chunks,
                                   CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1)
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
