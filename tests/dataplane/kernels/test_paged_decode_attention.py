"""The persistent paged decode kernel against its float32 torch reference.

Context lengths straddle block boundaries (block_size +- 1), tile boundaries (64 +- 1) and
include 1; the number of programs per kv head varies from one (every request whole in one
range) to more than there are tiles (every request cut into one-tile pieces), so requests are
cut at every kind of range boundary. Unused cache slots, blocks and block-table entries are NaN
so any read past a request's length shows up in the output; outputs start as NaN so any
unwritten element shows up too.
"""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.paged_decode_attention import (  # noqa: E402
    paged_decode_attention, paged_decode_attention_ref, plan_decode)
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, int32, make_paged_cache, nan_like, on_gpu, randn,
    skip_unsupported)

pytestmark = KERNEL_MARKS

HEADS = [(16, 8), (32, 8), (4, 4), (12, 4), (16, 1)]  # (q heads, kv heads): GQA 2, 4, 1, 3, 16


def run_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
             num_programs=None):
    cache = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, device=device, gen=gen)
    lens = int32(seq_lens, device)
    scale = head_dim ** -0.5
    plan = plan_decode(q, cache.k_cache, cache.block_tables, lens, num_programs=num_programs)
    out = paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, lens, scale,
                                 out=nan_like(q), plan=plan)
    assert not plan.counters.any(), "a merge counter was left set for the next layer"
    expected = paged_decode_attention_ref(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                          lens, scale)
    assert_close(out, expected, dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 4, 128])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, block_size, device, gen):
    skip_unsupported(dtype, device)
    seq_lens = [1, block_size - 1 or 1, block_size, block_size + 1, 63, 64, 65, 200]
    for num_programs in (1, 3, None):
        run_case(seq_lens, num_heads, num_kv_heads, 128, block_size, dtype, device, gen,
                 num_programs=num_programs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_head_dims(dtype, head_dim, device, gen):
    skip_unsupported(dtype, device)
    for num_programs in (1, 2):
        run_case([1, 15, 17, 130], 8, 2, head_dim, 16, dtype, device, gen,
                 num_programs=num_programs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_programs", [1, 2, 5, 16, 64, 10**4, None])
def test_decode_long_contexts_over_programs(dtype, num_programs, device, gen):
    """Long contexts cut over many ranges; more programs than tiles: one tile each."""
    skip_unsupported(dtype, device)
    longest = 8192 if on_gpu(device) else 1100
    seq_lens = [longest, 1, 257, longest // 2 + 3, 64 * 5]
    run_case(seq_lens, 16, 8, 128, 16, dtype, device, gen, num_programs=num_programs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_decode_batches(dtype, batch, device, gen):
    skip_unsupported(dtype, device)
    longest = 2048 if on_gpu(device) else 300
    seq_lens = torch.randint(1, longest, (batch,), generator=gen).tolist()
    run_case(seq_lens, 32, 8, 128, 16, dtype, device, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_programs", [1, 4])
def test_padded_rows_write_zeros(dtype, num_programs, device, gen):
    """Rows with seq_len 0 (a CUDA-graph batch padded to its captured size) point at the trap
    block only; they must write finite zeros, and leave the real rows exact."""
    skip_unsupported(dtype, device)
    out = run_case([0, 70, 0, 1, 0], 16, 8, 128, 16, dtype, device, gen,
                   num_programs=num_programs)
    assert not out[[0, 2, 4]].any()


def test_plan_lists_every_tile_in_request_order(device, gen):
    """The tile list by hand: 16-key tiles (float32) over 4-token blocks, four block ids a tile;
    an empty request is one tile of no keys."""
    lens = [17, 0, 16, 33]
    cache = make_paged_cache(lens, 4, 2, 16, torch.float32, device, gen)
    q = randn(len(lens), 4, 16, dtype=torch.float32, device=device, gen=gen)
    plan = plan_decode(q, cache.k_cache, cache.block_tables, int32(lens, device))
    assert plan.req_tile_start.tolist() == [0, 2, 3, 4, 7]
    assert plan.tile_req[:7].tolist() == [0, 0, 1, 2, 3, 3, 3]
    first, last = 1 << 16, 1 << 17
    assert plan.tile_info[:7].tolist() == [16 | first, 1 | last, 0 | first | last,
                                           16 | first | last, 16 | first, 16, 1 | last]
    blocks = plan.tile_blocks.view(-1, 4)[:7]
    tables = cache.block_tables
    assert blocks[0].tolist() == tables[0, :4].tolist()
    assert blocks[1].tolist() == [tables[0, 4].item(), 0, 0, 0]  # past the request: zeros
    assert blocks[6].tolist() == [tables[3, 8].item(), 0, 0, 0]
    assert not plan.counters.any()


def test_plan_of_tiles_inside_pages(device, gen):
    """32-token blocks, 16-key tiles: one block id a tile and the tile's offset in its page."""
    cache = make_paged_cache([40], 32, 2, 16, torch.float32, device, gen)
    q = randn(1, 4, 16, dtype=torch.float32, device=device, gen=gen)
    plan = plan_decode(q, cache.k_cache, cache.block_tables, int32([40], device))
    first, last, offset = 1 << 16, 1 << 17, 1 << 18
    assert plan.tile_info[:3].tolist() == [16 | first, 16 | 16 * offset, 8 | last]
    table = cache.block_tables[0].tolist()
    assert plan.tile_blocks[:3].tolist() == [table[0], table[0], table[1]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_replays_under_a_cuda_graph(gen):
    """The plan and the kernel captured once, replayed after the lengths and block tables change
    in place: the output follows the new values (nothing was baked in at capture)."""
    device = torch.device("cuda")
    num_heads, num_kv_heads, head_dim, block_size = 16, 8, 128, 16
    cache = make_paged_cache([1024] * 3, block_size, num_kv_heads, head_dim, torch.bfloat16,
                             device, gen)
    q = randn(3, num_heads, head_dim, dtype=torch.bfloat16, device=device, gen=gen)
    lens = int32([300, 5, 1000], device)
    tables = cache.block_tables.clone()
    out = torch.empty_like(q)
    args = (q, cache.k_cache, cache.v_cache, tables, lens, head_dim ** -0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode_attention(*args, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    for seq_lens in ([300, 5, 1000], [1, 1024, 0], [17, 0, 640]):
        lens.copy_(int32(seq_lens, device))
        tables.copy_(tables[torch.randperm(3, generator=gen).to(device)])
        graph.replay()
        expected = paged_decode_attention_ref(q, cache.k_cache, cache.v_cache, tables, lens,
                                              head_dim ** -0.5)
        assert_close(out, expected, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a race needs concurrent programs")
@pytest.mark.parametrize("num_programs", [None, 10**4])
def test_merges_repeat_exactly_with_one_plan(num_programs, gen):
    """One plan for many launches, as the layers of a forward share it: the merge counters must
    come back to zero and every merge must see all its pieces, so 200 launches give the same
    bits (pieces merge in a fixed order) and match the reference."""
    device = torch.device("cuda")
    seq_lens = torch.randint(1, 3000, (64,), generator=gen).tolist()
    cache = make_paged_cache(seq_lens, 16, 8, 128, torch.bfloat16, device, gen)
    q = randn(64, 16, 128, dtype=torch.bfloat16, device=device, gen=gen)
    lens = int32(seq_lens, device)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, lens, 128 ** -0.5)
    plan = plan_decode(q, cache.k_cache, cache.block_tables, lens, num_programs=num_programs)
    first = paged_decode_attention(*args, plan=plan)
    assert_close(first, paged_decode_attention_ref(*args), torch.bfloat16)
    for _ in range(200):
        assert torch.equal(paged_decode_attention(*args, plan=plan), first)
    assert not plan.counters.any()
