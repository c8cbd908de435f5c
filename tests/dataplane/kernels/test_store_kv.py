import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.store_kv import store_kv, store_kv_ref  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, randn, skip_unsupported)

pytestmark = KERNEL_MARKS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16, 128])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (2, 16), (3, 64), (1, 128)])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_store_matches_reference_exactly(dtype, block_size, num_kv_heads, head_dim, num_tokens,
                                         device, gen):
    """Written slots hold the new k/v bit for bit; every other slot keeps its NaN poison;
    negative slots (padding) write nothing."""
    skip_unsupported(dtype, device)
    num_blocks = -(-2 * num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding rows
    slots = slots.to(device)
    # k as a strided view, like the k part of a fused QKV output; v contiguous
    qkv = randn(num_tokens, 3 * num_kv_heads * head_dim, dtype=dtype, device=device, gen=gen)
    k = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(-1, num_kv_heads, head_dim)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device, gen=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv = torch.full((2, *shape), float("nan"), dtype=dtype, device=device)
    expected = kv.clone()
    store_kv(k, v, kv[0], kv[1], slots)
    store_kv_ref(k, v, expected[0], expected[1], slots)
    assert torch.equal(kv.isnan(), expected.isnan())
    assert torch.equal(kv.nan_to_num(), expected.nan_to_num())
    assert (~kv.isnan()).sum() == 2 * (slots >= 0).sum() * num_kv_heads * head_dim


def test_store_of_no_tokens_is_a_no_op(device):
    cache = torch.zeros(2, 4, 16, 2, 16, device=device)
    empty = torch.empty(0, 2, 16, device=device)
    store_kv(empty, empty, cache[0], cache[1], torch.empty(0, dtype=torch.int64, device=device))
    assert not cache.any()
