"""The varlen paged prefill kernel against its float32 torch reference.

Requests mix fresh prompts, chunks after cached tokens (prefix hits, chunked prefill), single
tokens (decodes in a mixed batch) and empty rows; query tiles and key tiles straddle their
boundaries. Unused cache slots are NaN and outputs start as NaN.
"""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.paged_prefill_attention import (  # noqa: E402
    paged_prefill_attention, paged_prefill_attention_ref)
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, cumsum0, int32, make_paged_cache, nan_like, on_gpu, randn,
    skip_unsupported)

pytestmark = KERNEL_MARKS

HEADS = [(16, 8), (32, 8), (4, 4), (12, 4), (16, 1)]  # (q heads, kv heads): GQA 2, 4, 1, 3, 16
# (new tokens, cached tokens) per request
MIXED = [(7, 0), (1, 40), (70, 0), (1, 0), (33, 31), (0, 5), (129, 64), (16, 200), (1, 1)]


def run_case(query_lens, cached_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
             device, gen, max_query_len=None, config=None):
    seq_lens = [q + c for q, c in zip(query_lens, cached_lens)]
    cache = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q = randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device=device, gen=gen)
    query_start_loc = int32(cumsum0(query_lens), device)
    lens = int32(seq_lens, device)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                  query_start_loc, lens, scale,
                                  max_query_len=max_query_len or max(query_lens), out=nan_like(q),
                                  config=config)
    expected = paged_prefill_attention_ref(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                           query_start_loc, lens, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 4, 128])
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, block_size, device, gen):
    skip_unsupported(dtype, device)
    query_lens, cached_lens = zip(*MIXED)
    run_case(list(query_lens), list(cached_lens), num_heads, num_kv_heads, 128, block_size, dtype,
             device, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_decodes", [1, 3])
def test_a_slice_after_leading_decodes(dtype, num_decodes, device, gen):
    """The requests after the first num_decodes, as the Triton backend launches them in a mixed
    step: slices [d:] of q, out and the per-request arrays (at unaligned offsets), first_token d."""
    skip_unsupported(dtype, device)
    query_lens = [1] * num_decodes + [37, 1, 70, 16]
    cached_lens = [40, 0, 9][:num_decodes] + [0, 5, 3, 112]
    seq_lens = [q + c for q, c in zip(query_lens, cached_lens)]
    cache = make_paged_cache(seq_lens, 16, 8, 128, dtype, device, gen)
    q = randn(sum(query_lens), 16, 128, dtype=dtype, device=device, gen=gen)
    query_start_loc, lens = int32(cumsum0(query_lens), device), int32(seq_lens, device)
    d, out = num_decodes, nan_like(q)
    paged_prefill_attention(q[d:], cache.k_cache, cache.v_cache, cache.block_tables[d:],
                            query_start_loc[d:], lens[d:], 128 ** -0.5, max_query_len=70,
                            out=out[d:], first_token=d)
    expected = paged_prefill_attention_ref(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                           query_start_loc, lens, 128 ** -0.5)
    assert_close(out[d:], expected[d:], dtype)
    assert out[:d].isnan().all(), "wrote outside its slice"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_prefill_head_dims(dtype, head_dim, device, gen):
    skip_unsupported(dtype, device)
    run_case([5, 1, 40], [0, 17, 9], 8, 2, head_dim, 16, dtype, device, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_query_len", [1, 3, 16])
def test_short_queries_pick_small_tiles(dtype, max_query_len, device, gen):
    """Decode-only and short-chunk batches take the small-tile configurations."""
    skip_unsupported(dtype, device)
    query_lens = [max_query_len, 1, max_query_len]
    run_case(query_lens, [0, 100, 63], 16, 8, 128, 16, dtype, device, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8)])
def test_long_prompts(dtype, num_heads, num_kv_heads, device, gen):
    """Thousands of tokens (on GPU): one long prompt, one long chunk after a long prefix."""
    skip_unsupported(dtype, device)
    if on_gpu(device):
        query_lens, cached_lens = [2048, 1500, 1, 300], [0, 2600, 4000, 0]
    else:
        query_lens, cached_lens = [200, 130, 1], [0, 70, 300]
    run_case(query_lens, cached_lens, num_heads, num_kv_heads, 128, 16, dtype, device, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_batches(dtype, device, gen):
    skip_unsupported(dtype, device)
    batch, longest = (32, 1024) if on_gpu(device) else (6, 90)
    query_lens = torch.randint(1, longest, (batch,), generator=gen).tolist()
    cached_lens = torch.randint(0, longest, (batch,), generator=gen).tolist()
    run_case(query_lens, cached_lens, 32, 8, 128, 16, dtype, device, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("last_tiles_first", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (12, 4)])
def test_both_grids(dtype, last_tiles_first, num_heads, num_kv_heads, device, gen):
    """Each grid on the mixed batch, whichever the launch would pick."""
    skip_unsupported(dtype, device)
    query_lens, cached_lens = zip(*MIXED)
    run_case(list(query_lens), list(cached_lens), num_heads, num_kv_heads, 128, 16, dtype,
             device, gen, config=dict(LAST_TILES_FIRST=last_tiles_first))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_query_len", [200, 600])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (12, 4)])
def test_a_loose_max_query_len(dtype, max_query_len, num_heads, num_kv_heads, device, gen):
    """A bound above the longest query (the mixed batch's is 129): the last-first grid's
    programs past a request's last query tile return at once (from 512, in 16-bit dtypes, with
    the 3-stage config)."""
    skip_unsupported(dtype, device)
    query_lens, cached_lens = zip(*MIXED)
    run_case(list(query_lens), list(cached_lens), num_heads, num_kv_heads, 128, 16, dtype,
             device, gen, max_query_len=max_query_len, config=dict(LAST_TILES_FIRST=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_long_prompt_among_many_short_requests(dtype, device, gen):
    """The launch a last-first grid would leave mostly idle (one long prompt, 40 requests of
    1-3 tokens after cached ones) takes the searched grid."""
    skip_unsupported(dtype, device)
    query_lens = [1 + i % 3 for i in range(40)] + [300 if on_gpu(device) else 90]
    cached_lens = [17 + i for i in range(40)] + [0]
    run_case(query_lens, cached_lens, 16, 8, 128, 16, dtype, device, gen)
