"""The memory-bound fusions (residual + RMSNorm, SiLU-and-mul, q/k norm + RoPE) against the torch code the
model runs on CPU. They round like that code, so most elements match exactly; tolerances allow
one rounding of the output dtype."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref  # noqa: E402
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
@pytest.mark.parametrize("num_heads", [16, 8, 3])
def test_rms_norm_over_heads_of_a_strided_view(dtype, num_tokens, num_heads, device, gen):
    """The q/k norms: rows of head_dim inside a [tokens, heads, head_dim] view of the QKV output."""
    skip_unsupported(dtype, device)
    head_dim = 128
    qkv = randn(num_tokens, (num_heads + 4) * head_dim, dtype=dtype, device=device, gen=gen)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    weight = randn(head_dim, dtype=dtype, device=device, gen=gen)
    out = rms_norm(q, weight, EPS)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, rms_norm_ref(q, weight, EPS), dtype)


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
def test_qk_norm_rope_on_views(dtype, num_tokens, num_heads, num_kv_heads, head_dim, device,
                               gen):
    """q and k as views of one fused QKV output: per-head RMSNorm then RoPE, into new tensors;
    the QKV output is left as it was."""
    skip_unsupported(dtype, device)
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device, gen=gen, scale=3.0)
    before = qkv.clone()
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    q_weight = randn(head_dim, dtype=dtype, device=device, gen=gen)
    k_weight = randn(head_dim, dtype=dtype, device=device, gen=gen)
    args = (positions, q, k, q_weight, k_weight, EPS, rope.cos_sin_cache)
    expected_q, expected_k = qk_norm_rope_ref(*args)
    out_q, out_k = qk_norm_rope(*args)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert_close(out_q, expected_q, dtype)
    assert_close(out_k, expected_k, dtype)
    assert torch.equal(qkv, before)
