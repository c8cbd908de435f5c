"""The TMA GEMM (plain and with SiLU-and-mul in its epilogue) against cuBLAS / torch, and the
layers that take it at 177-256 rows (qkv_proj, the dense MLP's gate_up_proj) and in prompt steps
(gate_up_proj)."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.tma_matmul import (  # noqa: E402
    MAX_ROWS, MIN_ROWS, PREFILL_GROUPED_ABOVE, PREFILL_MIN_ROWS, tma_matmul, tma_matmul_pays,
    tma_matmul_ref)
from dataplane.layers.linear import QKVParallelLinear  # noqa: E402
from dataplane.models.qwen3 import Qwen3MLP  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    KERNEL_MARKS, assert_close, gemm_operands, nan_like, on_gpu, randn, skip_unsupported)

pytestmark = KERNEL_MARKS


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("num_rows", [1, 7, 177, 200, 256])
@pytest.mark.parametrize("n,k", [(6144, 1024), (256, 128)])
def test_tma_matmul_against_torch(dtype, gated, num_rows, n, k, device, gen):
    """Row counts off the 64-row tile (the last tile's rows past the batch read as zeros and
    are not stored) and below MIN_ROWS (correct, only not the faster)."""
    skip_unsupported(dtype, device)
    x, w = gemm_operands(num_rows, n, k, dtype, device, gen)
    y = tma_matmul(x, w, gated=gated)
    assert y.shape == (num_rows, n // 2 if gated else n) and y.dtype == dtype
    assert_close(y, tma_matmul_ref(x, w, gated), dtype)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("group_m", [0, 2, 3])
@pytest.mark.parametrize("num_rows", [300, 700])
def test_grouped_row_tiles_cover_every_tile_once(gated, group_m, num_rows, device, gen):
    """GROUP_M walks the column strips a few row tiles at a time (prompt steps); the last group
    is shorter when GROUP_M does not divide the row tiles (5 and 11 tiles of 64 rows here)."""
    dtype = torch.float16
    x, w = gemm_operands(num_rows, 256, 128, dtype, device, gen)
    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_stages=2, num_warps=4, GROUP_M=group_m)
    assert_close(tma_matmul(x, w, gated, cfg), tma_matmul_ref(x, w, gated), dtype)


@pytest.mark.parametrize("gated", [False, True])
def test_tma_matmul_of_strided_rows_into_a_given_buffer(gated, device, gen):
    """Rows that are a slice of a wider tensor, output written into `out` and nothing past its
    rows; no rows: no launch."""
    dtype = torch.float16
    wide = randn(70, 128 + 64, dtype=dtype, device=device, gen=gen)
    x = wide[:, :128]
    w = randn(256, 128, dtype=dtype, device=device, gen=gen, scale=128 ** -0.5)
    buffer = nan_like(torch.empty(80, 128 if gated else 256, dtype=dtype, device=device))
    out = buffer[:70]
    assert tma_matmul(x, w, gated=gated, out=out) is out
    assert_close(out, tma_matmul_ref(x, w, gated), dtype)
    assert buffer[70:].isnan().all()
    assert tma_matmul(x[:0], w, gated=gated).shape == (0, out.shape[1])


@pytest.mark.parametrize("num_rows", [MIN_ROWS - 1, MIN_ROWS, 192, MAX_ROWS, MAX_ROWS + 1,
                                      PREFILL_MIN_ROWS - 1, PREFILL_MIN_ROWS + 100,
                                      PREFILL_GROUPED_ABOVE + 1])
def test_qkv_and_mlp_layers_in_bf16_at_large_batches(num_rows, device, gen):
    """Qwen3-0.6B's qkv_proj and MLP against cuBLAS, silu_and_mul and cuBLAS: the TMA GEMM
    (gate_up_proj with its gated epilogue) at MIN_ROWS-MAX_ROWS rows and gate_up_proj from
    PREFILL_MIN_ROWS (a prompt step's rows; in grouped row tiles above PREFILL_GROUPED_ABOVE),
    cuBLAS elsewhere."""
    if not on_gpu(device) or torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("the TMA GEMM runs on CUDA devices of compute capability 9 and later")
    dtype = torch.bfloat16
    qkv = QKVParallelLinear(1024, 128, 16, 8).to(device, dtype)
    qkv.weight.copy_(randn(4096, 1024, dtype=dtype, device=device, gen=gen, scale=1024 ** -0.5))
    mlp = Qwen3MLP(1024, 3072).to(device, dtype)
    mlp.gate_up_proj.weight.copy_(randn(6144, 1024, dtype=dtype, device=device, gen=gen,
                                        scale=1024 ** -0.5))
    mlp.down_proj.weight.copy_(randn(1024, 3072, dtype=dtype, device=device, gen=gen,
                                     scale=3072 ** -0.5))
    x = randn(num_rows, 1024, dtype=dtype, device=device, gen=gen)
    takes_it = MIN_ROWS <= num_rows <= MAX_ROWS
    assert tma_matmul_pays(x, 4096, 1024) == takes_it
    assert tma_matmul_pays(x, 3072, 1024, gated=True) == (takes_it
                                                          or num_rows >= PREFILL_MIN_ROWS)
    with torch.inference_mode():
        assert_close(qkv(x), torch.nn.functional.linear(x, qkv.weight), dtype)
        hidden = tma_matmul_ref(x, mlp.gate_up_proj.weight, gated=True)
        expected = torch.nn.functional.linear(hidden, mlp.down_proj.weight)
        assert_close(mlp(x), expected, dtype)
