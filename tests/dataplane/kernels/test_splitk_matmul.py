"""The split-K GEMM's partials against float32 torch, and the residual-add + RMSNorm that sums
them against the torch code it replaces (a GEMM's output rounded to the dtype, then the add)."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.checkpoints import TinyQwen3  # noqa: E402
from dataplane.kernels.rmsnorm import fused_add_rms_norm_parts, rms_norm_ref  # noqa: E402
from dataplane.kernels.splitk_matmul import (  # noqa: E402
    splitk_matmul, splitk_matmul_ref, splitk_pays)
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, randn, skip_unsupported)

pytestmark = KERNEL_MARKS
EPS = 1e-6
# float32 partials of K / SPLITS products: the accumulation order is the only difference
PART_TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 7, 64, 100])
@pytest.mark.parametrize("n,k,splits", [(1024, 2048, 8), (1024, 3072, 4), (128, 256, 2)])
def test_splitk_partials(dtype, num_rows, n, k, splits, device, gen):
    skip_unsupported(dtype, device)
    if device.type == "cpu" and n * k > 128 * 256 and num_rows > 7:
        pytest.skip("the interpreter is slow: the large shapes at 1 and 7 rows only")
    x = randn(num_rows, k, dtype=dtype, device=device, gen=gen)
    w = randn(n, k, dtype=dtype, device=device, gen=gen, scale=k ** -0.5)
    config = dict(SPLITS=splits) if dtype != torch.float32 else dict(SPLITS=splits, BLOCK_K=32)
    parts = splitk_matmul(x, w, config=config)
    assert parts.shape == (splits, num_rows, n) and parts.dtype == torch.float32
    tol = PART_TOLERANCES[dtype]
    torch.testing.assert_close(parts, splitk_matmul_ref(x, w, splits), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 7, 256])
def test_fused_add_rms_norm_sums_the_partials(dtype, num_rows, device, gen):
    skip_unsupported(dtype, device)
    hidden, splits = 1024, 4
    parts = randn(splits, num_rows, hidden, dtype=torch.float32, device=device, gen=gen)
    residual = randn(num_rows, hidden, dtype=dtype, device=device, gen=gen, scale=4.0)
    weight = randn(hidden, dtype=dtype, device=device, gen=gen)
    expected_out, expected_residual = rms_norm_ref(parts.sum(0).to(dtype), weight, EPS, residual)
    out, new_residual = fused_add_rms_norm_parts(parts, residual, weight, EPS)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert_close(new_residual, expected_residual, dtype)
    assert_close(out, expected_out, dtype)


def test_the_tiny_checkpoints_take_the_split_k_path():
    """The float32 GPU tests against transformers (test_gpu_runner.py) cover the split-K o_proj
    and down_proj only if their tiny shapes fit its tiles."""
    c = TinyQwen3()
    o_proj = (c.hidden_size, c.num_attention_heads * c.head_dim)  # (N, K)
    down_proj = (c.hidden_size, c.intermediate_size)
    for n, k in (o_proj, down_proj):
        assert splitk_pays(16, n, k, torch.float32)
    assert not splitk_pays(129, *o_proj, torch.float32)  # above MAX_ROWS: cuBLAS
