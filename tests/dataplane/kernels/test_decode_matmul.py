"""The decode GEMM (plain and with SiLU-and-mul in its epilogue) against cuBLAS / torch and the
silu_and_mul kernel it replaces, and the layers that take it (qkv_proj, the dense MLP)."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.checkpoints import DEFAULT_MODEL, TinyQwen3  # noqa: E402
from dataplane.kernels.decode_matmul import (  # noqa: E402
    MAX_ROWS, MAX_ROWS_PLAIN, MAX_ROWS_PLAIN_MLP, decode_matmul, decode_matmul_pays,
    decode_matmul_ref)
from dataplane.layers.linear import QKVParallelLinear  # noqa: E402
from dataplane.models.qwen3 import Qwen3MLP  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, gemm_operands, nan_like, on_gpu, randn, skip_unsupported)

pytestmark = KERNEL_MARKS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("num_rows", [1, 7, 64, 100])
@pytest.mark.parametrize("n,k", [(4096, 1024), (256, 128)])
def test_decode_matmul_against_torch(dtype, gated, num_rows, n, k, device, gen):
    skip_unsupported(dtype, device)
    x, w = gemm_operands(num_rows, n, k, dtype, device, gen)
    y = decode_matmul(x, w, gated=gated)
    assert y.shape == (num_rows, n // 2 if gated else n) and y.dtype == dtype
    assert_close(y, decode_matmul_ref(x, w, gated), dtype)


@pytest.mark.parametrize("gated", [False, True])
def test_decode_matmul_of_strided_rows_into_a_given_buffer(gated, device, gen):
    """Rows that are a slice of a wider tensor, output written into `out`; no rows: no launch."""
    dtype = torch.float32
    wide = randn(9, 128 + 64, dtype=dtype, device=device, gen=gen)
    x = wide[:, :128]
    w = randn(128, 128, dtype=dtype, device=device, gen=gen, scale=128 ** -0.5)
    out = nan_like(torch.empty(9, 64 if gated else 128, device=device))
    assert decode_matmul(x, w, gated=gated, out=out) is out
    assert_close(out, decode_matmul_ref(x, w, gated), dtype)
    assert decode_matmul(x[:0], w, gated=gated).shape == (0, out.shape[1])


def qkv_shape(c: TinyQwen3) -> tuple[int, int]:
    return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size


def test_the_tiny_checkpoints_take_the_decode_gemm():
    """The float32 GPU tests against transformers (test_gpu_runner.py) cover qkv_proj and the
    gated gate_up_proj only if their tiny shapes fit the tiles."""
    c = TinyQwen3()
    qkv = qkv_shape(c)
    assert decode_matmul_pays(16, *qkv, torch.float32)
    assert decode_matmul_pays(16, c.intermediate_size, c.hidden_size, torch.float32, gated=True)
    assert decode_matmul_pays(MAX_ROWS + 1, *qkv, torch.float32)
    assert not decode_matmul_pays(MAX_ROWS_PLAIN + 1, *qkv, torch.float32)
    assert not decode_matmul_pays(MAX_ROWS + 1, c.intermediate_size, c.hidden_size,
                                  torch.float32, gated=True)


def test_the_default_model_takes_the_bf16_decode_gemm():
    """test_gpu_runner.py's bf16 compile probe runs the default model so that the bf16 tiles
    (both row tile sizes) are among what configure must compile."""
    c = DEFAULT_MODEL
    assert decode_matmul_pays(MAX_ROWS_PLAIN, *qkv_shape(c), torch.bfloat16)
    assert decode_matmul_pays(1, c.intermediate_size, c.hidden_size, torch.bfloat16, gated=True)


@pytest.mark.parametrize("num_rows", [1, MAX_ROWS, MAX_ROWS + 1, MAX_ROWS_PLAIN_MLP,
                                      MAX_ROWS_PLAIN_MLP + 1, MAX_ROWS_PLAIN, MAX_ROWS_PLAIN + 1])
def test_qkv_and_mlp_layers_in_bf16(num_rows, device, gen):
    """Qwen3-0.6B's qkv_proj and MLP against cuBLAS, silu_and_mul and cuBLAS: the decode GEMM
    up to MAX_ROWS_PLAIN rows for qkv_proj (its wider tiles above MAX_ROWS); for gate_up_proj
    the gated kernel up to MAX_ROWS, the plain one and silu_and_mul up to MAX_ROWS_PLAIN_MLP,
    cuBLAS above."""
    if not on_gpu(device):
        pytest.skip("the decode GEMM path runs on CUDA only")
    dtype = torch.bfloat16
    qkv = QKVParallelLinear(1024, 128, 16, 8).to(device, dtype)
    qkv.weight.copy_(randn(4096, 1024, dtype=dtype, device=device, gen=gen, scale=1024 ** -0.5))
    mlp = Qwen3MLP(1024, 3072).to(device, dtype)
    mlp.gate_up_proj.weight.copy_(randn(6144, 1024, dtype=dtype, device=device, gen=gen,
                                        scale=1024 ** -0.5))
    mlp.down_proj.weight.copy_(randn(1024, 3072, dtype=dtype, device=device, gen=gen,
                                     scale=3072 ** -0.5))
    assert decode_matmul_pays(num_rows, 4096, 1024, dtype) == (num_rows <= MAX_ROWS_PLAIN)
    assert decode_matmul_pays(num_rows, 3072, 1024, dtype, gated=True) == (num_rows <= MAX_ROWS)
    assert decode_matmul_pays(num_rows, 6144, 1024, dtype, before_silu=True) == (
        num_rows <= MAX_ROWS_PLAIN_MLP)
    x = randn(num_rows, 1024, dtype=dtype, device=device, gen=gen)
    with torch.inference_mode():
        assert_close(qkv(x), torch.nn.functional.linear(x, qkv.weight), dtype)
        hidden = decode_matmul_ref(x, mlp.gate_up_proj.weight, gated=True)
        expected = torch.nn.functional.linear(hidden, mlp.down_proj.weight)
        y = mlp(x)
        y = y.sum(0).to(dtype) if y.dim() == 3 else y  # split-K partials up to 128 rows
    assert_close(y, expected, dtype)
