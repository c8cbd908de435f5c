"""The memory-bound fusions (residual + RMSNorm, SiLU-and-mul, q/k norm + RoPE + K/V store)
against the torch code the model runs on CPU. They round like that code, so most elements match
exactly; tolerances allow one rounding of the output dtype."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_ref  # noqa: E402
from dataplane.kernels.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_ref  # noqa: E402
from dataplane.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402
from dataplane.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, nan_like, randn, skip_unsupported)

pytestmark = KERNEL_MARKS
EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
@pytest.mark.parametrize("hidden", [1024, 4096, 96, 128])
def test_rms_norm(dtype, num_tokens, hidden, device, gen):
    skip_unsupported(dtype, device)
    x = randn(num_tokens, hidden, dtype=dtype, device=device, gen=gen, scale=3.0)
    weight = randn(hidden, dtype=dtype, device=device, gen=gen)
    out = rms_norm(x, weight, EPS, out=nan_like(x))
    assert_close(out, rms_norm_ref(x, weight, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
def test_rms_norm_of_strided_rows(dtype, num_tokens, device, gen):
    """Rows that are a slice of a wider tensor: read with their stride, written contiguous."""
    skip_unsupported(dtype, device)
    wide = randn(num_tokens, 1024 + 96, dtype=dtype, device=device, gen=gen, scale=3.0)
    x = wide[:, :1024]
    weight = randn(1024, dtype=dtype, device=device, gen=gen)
    out = rms_norm(x, weight, EPS)
    assert out.is_contiguous()
    assert_close(out, rms_norm_ref(x, weight, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
@pytest.mark.parametrize("hidden", [1024, 4096, 96])
def test_fused_add_rms_norm_in_place(dtype, num_tokens, hidden, device, gen):
    skip_unsupported(dtype, device)
    x = randn(num_tokens, hidden, dtype=dtype, device=device, gen=gen)
    residual = randn(num_tokens, hidden, dtype=dtype, device=device, gen=gen, scale=4.0)
    weight = randn(hidden, dtype=dtype, device=device, gen=gen)
    expected_out, expected_residual = rms_norm_ref(x, weight, EPS, residual)
    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert_close(new_residual, expected_residual, dtype)
    assert_close(out, expected_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 256])
@pytest.mark.parametrize("width", [3072, 12288, 100])
def test_silu_and_mul(dtype, num_tokens, width, device, gen):
    skip_unsupported(dtype, device)
    x = randn(num_tokens, 2 * width, dtype=dtype, device=device, gen=gen, scale=3.0)
    out = silu_and_mul(x, out=nan_like(x[:, :width]))
    assert_close(out, silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 9, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 128), (32, 8, 128),
                                                             (4, 2, 16), (6, 3, 64)])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_qk_norm_rope_store_writes_k_and_v_at_their_slots(dtype, num_tokens, num_heads,
                                                          num_kv_heads, head_dim, block_size,
                                                          device, gen):
    """Qwen3's attention prologue in one launch: q normalized and rotated into a new tensor; the
    normalized, rotated k and the untouched v at their slots of the paged cache (padding rows,
    slot -1, write nothing; every other slot keeps its NaN poison); the QKV output is left as
    it was."""
    skip_unsupported(dtype, device)
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device, gen=gen, scale=3.0)
    before = qkv.clone()
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    q_weight = randn(head_dim, dtype=dtype, device=device, gen=gen)
    k_weight = randn(head_dim, dtype=dtype, device=device, gen=gen)
    num_blocks = -(-2 * num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    slots = slots.to(device)
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                    dtype=dtype, device=device)
    expected_kv = kv.clone()
    args = (positions, q, k, v, q_weight, k_weight, EPS, rope.cos_sin_cache)
    expected_q = qk_norm_rope_store_ref(*args, expected_kv[0], expected_kv[1], slots)
    out_q = qk_norm_rope_store(*args, kv[0], kv[1], slots)
    assert out_q.is_contiguous()
    assert_close(out_q, expected_q, dtype)
    assert torch.equal(kv.isnan(), expected_kv.isnan())
    assert (~kv.isnan()).sum() == 2 * (slots >= 0).sum() * kv_size
    assert_close(kv.nan_to_num(), expected_kv.nan_to_num(), dtype)
    assert torch.equal(kv[1].nan_to_num(), expected_kv[1].nan_to_num())  # v: a copy
    assert torch.equal(qkv, before)
