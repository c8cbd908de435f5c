"""The split-KV paged decode kernel against its float32 torch reference.

Context lengths straddle block boundaries (block_size +- 1), tile boundaries (64 +- 1), split
boundaries and include 1; unused cache slots, blocks and block-table entries are NaN so any read
past a request's length shows up in the output; outputs start as NaN so any unwritten element
shows up too.
"""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.paged_decode_attention import (  # noqa: E402
    MAX_SPLITS, paged_decode_attention, paged_decode_attention_ref, pick_num_splits)
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, int32, make_paged_cache, nan_like, on_gpu, randn,
    skip_unsupported)

pytestmark = KERNEL_MARKS

HEADS = [(16, 8), (32, 8), (4, 4), (12, 4), (16, 1)]  # (q heads, kv heads): GQA 2, 4, 1, 3, 16


def run_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, gen,
             num_splits=None, max_seq_len=None):
    cache = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, device=device, gen=gen)
    lens = int32(seq_lens, device)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, cache.k_cache, cache.v_cache, cache.block_tables, lens, scale,
                                 num_splits=num_splits, max_seq_len=max_seq_len, out=nan_like(q))
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
    for num_splits in (1, 3):
        run_case(seq_lens, num_heads, num_kv_heads, 128, block_size, dtype, device, gen,
                 num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_head_dims(dtype, head_dim, device, gen):
    skip_unsupported(dtype, device)
    for num_splits in (1, 2):
        run_case([1, 15, 17, 130], 8, 2, head_dim, 16, dtype, device, gen, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16, 64, None])
def test_decode_long_contexts_over_splits(dtype, num_splits, device, gen):
    """Long contexts cut into splits; more splits than tiles leaves some splits empty."""
    skip_unsupported(dtype, device)
    longest = 8192 if on_gpu(device) else 1100
    seq_lens = [longest, 1, 257, longest // 2 + 3, 64 * 5]
    run_case(seq_lens, 16, 8, 128, 16, dtype, device, gen, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_decode_batches(dtype, batch, device, gen):
    skip_unsupported(dtype, device)
    longest = 2048 if on_gpu(device) else 300
    seq_lens = torch.randint(1, longest, (batch,), generator=gen).tolist()
    run_case(seq_lens, 32, 8, 128, 16, dtype, device, gen, max_seq_len=longest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_rows_write_zeros(dtype, num_splits, device, gen):
    """Rows with seq_len 0 (a CUDA-graph batch padded to its captured size) point at the trap
    block only; they must write finite zeros, and leave the real rows exact."""
    skip_unsupported(dtype, device)
    out = run_case([0, 70, 0, 1, 0], 16, 8, 128, 16, dtype, device, gen, num_splits=num_splits)
    assert not out[[0, 2, 4]].any()


def test_pick_num_splits_fills_the_gpu_and_stays_bounded(device):
    assert pick_num_splits(256, 8, 8192, device) == 1
    assert 1 < pick_num_splits(1, 8, 8192, device) <= 8192 // 256
    assert pick_num_splits(1, 8, 100, device) == 1  # one short split is enough
    assert 16 <= pick_num_splits(1, 1, 10**7, device) <= MAX_SPLITS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_replays_under_a_cuda_graph(gen):
    """Captured once with a fixed split count, replayed after the lengths and block tables
    change in place: the output follows the new values (nothing was baked in at capture)."""
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
        paged_decode_attention(*args, num_splits=8, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, num_splits=8, out=out)
    for seq_lens in ([300, 5, 1000], [1, 1024, 0], [17, 0, 640]):
        lens.copy_(int32(seq_lens, device))
        tables.copy_(tables[torch.randperm(3, generator=gen).to(device)])
        graph.replay()
        expected = paged_decode_attention_ref(q, cache.k_cache, cache.v_cache, tables, lens,
                                              head_dim ** -0.5)
        assert_close(out, expected, torch.bfloat16)
