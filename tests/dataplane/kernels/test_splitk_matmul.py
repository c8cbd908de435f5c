"""The split-K GEMM's partials against float32 torch, and the residual-add + RMSNorm that sums
them against the torch code it replaces (a GEMM's output rounded to the dtype, then the add)."""

import pytest
import torch

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from dataplane.checkpoints import TinyQwen3  # noqa: E402
from dataplane.kernels.rmsnorm import fused_add_rms_norm_parts, rms_norm_ref  # noqa: E402
from dataplane.kernels.splitk_matmul import (  # noqa: E402
    MAX_ROWS, splitk_matmul, splitk_matmul_ref, splitk_pays)
from dataplane.layers.layernorm import RMSNorm  # noqa: E402
from dataplane.layers.linear import RowParallelLinear  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, gemm_operands, on_gpu, randn, skip_unsupported)

pytestmark = KERNEL_MARKS
EPS = 1e-6
# float32 partials of K / SPLITS exact products: the accumulation order is the only difference
# (a partial rounded to a 16-bit dtype would be ~1e-3 off)
PART_TOLERANCE = 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 7, 64, 100])
@pytest.mark.parametrize("n,k,splits", [(1024, 2048, 8), (1024, 3072, 4), (128, 256, 2)])
def test_splitk_partials(dtype, num_rows, n, k, splits, device, gen):
    skip_unsupported(dtype, device)
    x, w = gemm_operands(num_rows, n, k, dtype, device, gen)
    parts = splitk_matmul(x, w, config=dict(SPLITS=splits))
    assert parts.shape == (splits, num_rows, n) and parts.dtype == torch.float32
    torch.testing.assert_close(parts, splitk_matmul_ref(x, w, splits), atol=PART_TOLERANCE,
                               rtol=PART_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_splitk_of_strided_rows_into_a_given_buffer(dtype, device, gen):
    """Rows that are a slice of a wider tensor, partials written into `out`; no rows: no launch."""
    skip_unsupported(dtype, device)
    wide = randn(9, 256 + 64, dtype=dtype, device=device, gen=gen)
    x = wide[:, :256]
    w = randn(128, 256, dtype=dtype, device=device, gen=gen, scale=256 ** -0.5)
    out = torch.full((2, 9, 128), float("nan"), device=device)
    assert splitk_matmul(x, w, config=dict(SPLITS=2), out=out) is out
    torch.testing.assert_close(out, splitk_matmul_ref(x, w, 2), atol=PART_TOLERANCE,
                               rtol=PART_TOLERANCE)
    assert splitk_matmul(x[:0], w, config=dict(SPLITS=2)).shape == (2, 0, 128)


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


@pytest.mark.parametrize("num_rows", [1, 64, MAX_ROWS, MAX_ROWS + 1])
def test_row_parallel_layer_and_its_norm_in_bf16(num_rows, device, gen):
    """Qwen3-0.6B's o_proj (2048 -> 1024) built with feeds_norm, then the residual add + RMSNorm,
    against cuBLAS and the torch norm: partials up to MAX_ROWS rows, cuBLAS's output above."""
    if not on_gpu(device):
        pytest.skip("the split-K path runs on CUDA only")
    dtype = torch.bfloat16
    layer = RowParallelLinear(2048, 1024, feeds_norm=True).to(device, dtype)
    layer.weight.copy_(randn(1024, 2048, dtype=dtype, device=device, gen=gen, scale=2048 ** -0.5))
    norm = RMSNorm(1024, EPS).to(device, dtype)
    norm.weight.copy_(randn(1024, dtype=dtype, device=device, gen=gen))
    x = randn(num_rows, 2048, dtype=dtype, device=device, gen=gen)
    residual = randn(num_rows, 1024, dtype=dtype, device=device, gen=gen, scale=4.0)
    with torch.inference_mode():
        y = layer(x)
        assert y.dim() == (3 if num_rows <= MAX_ROWS else 2)
        expected_out, expected_residual = rms_norm_ref(F.linear(x, layer.weight), norm.weight,
                                                       EPS, residual.clone())
        out, new_residual = norm(y, residual)
    assert_close(new_residual, expected_residual, dtype)
    assert_close(out, expected_out, dtype)
