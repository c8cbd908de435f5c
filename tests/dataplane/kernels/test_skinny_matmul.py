"""The skinny matmul against F.linear (cuBLAS on CUDA, torch on CPU), for every config on shapes it
tiles, and the start-up plan's choice rule."""

import pytest
import torch

pytest.importorskip("triton")

import dataplane.kernels.skinny_matmul as skinny  # noqa: E402
from dataplane.kernels.skinny_matmul import (  # noqa: E402
    CONFIGS, fits, skinny_matmul, skinny_matmul_ref)
from dataplane.layers.gemm_plan import CUBLAS, choose, plan_linear_layers  # noqa: E402
from dataplane.layers.linear import RowParallelLinear  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    KERNEL_MARKS, assert_close, on_gpu, randn, skip_unsupported)

pytestmark = KERNEL_MARKS


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 128, 130])
def test_matches_linear(dtype, config, rows, device, gen):
    """130 rows take two row tiles; a 3-row x is a strided view (rows of a wider tensor)."""
    skip_unsupported(dtype, device)
    num_cols, depth = (256, 512) if on_gpu(device) else (128, 256)
    if not fits(CONFIGS[config], rows, num_cols, depth, dtype.itemsize):
        pytest.skip("this config does not fit the shape")
    x = randn(rows, depth + 64, dtype=dtype, device=device, gen=gen)[:, :depth]
    weight = randn(num_cols, depth, dtype=dtype, device=device, gen=gen, scale=0.05)
    out = torch.full((rows, num_cols), float("nan"), dtype=dtype, device=device)
    skinny_matmul(x, weight, CONFIGS[config], out=out)
    expected = skinny_matmul_ref(x.float(), weight.float()).to(dtype)
    assert_close(out, expected, dtype)


def test_a_layer_runs_its_plan_at_the_planned_sizes_only(device, gen, monkeypatch):
    layer = RowParallelLinear(256, 128).to(device=device, dtype=torch.float16)
    layer.weight.copy_(randn(128, 256, dtype=torch.float16, device=device, gen=gen, scale=0.05))
    layer.gemm_plan = {4: CONFIGS[1]}
    calls = []
    monkeypatch.setattr(skinny, "_skinny_matmul_kernel",
                        _Recorder(calls, skinny._skinny_matmul_kernel))
    for rows in (4, 5):
        x = randn(rows, 256, dtype=torch.float16, device=device, gen=gen)
        assert_close(layer(x), skinny_matmul_ref(x.float(), layer.weight.float()).half(),
                     torch.float16)
    assert calls == [4], "the skinny kernel ran for exactly the planned size"


class _Recorder:
    """Wraps a Triton kernel: records the row count of each launch."""

    def __init__(self, calls: list[int], kernel) -> None:
        self.calls, self.kernel = calls, kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(args[3])  # num_rows
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_start_up_plan_on_a_gpu(device, gen):
    """Real timings: every planned size is one of the given ones up to MAX_ROWS, its config fits,
    and the layers compute the same at every size either way."""
    if not on_gpu(device):
        pytest.skip("the plan times CUDA graphs")
    model = torch.nn.Sequential(*[RowParallelLinear(1024, 2048) for _ in range(3)])
    model.to(device=device, dtype=torch.bfloat16)
    for layer in model:
        layer.weight.copy_(randn(2048, 1024, dtype=torch.bfloat16, device=device, gen=gen,
                                 scale=0.03))
    report = plan_linear_layers(model, [1, 8, 16, 64, 128, 256])
    assert list(report) == ["2048x1024"]
    plan = model[0].gemm_plan
    assert all(layer.gemm_plan is plan for layer in model)
    assert set(plan) <= {1, 8, 16, 64, 128, 256}
    assert all(fits(config, rows, 2048, 1024, 2) for rows, config in plan.items())
    for rows in (1, 8, 16, 64, 128, 256):
        x = randn(rows, 1024, dtype=torch.bfloat16, device=device, gen=gen)
        assert_close(model[0](x), skinny_matmul_ref(x.float(), model[0].weight.float()).bfloat16(),
                     torch.bfloat16)


def test_fits_checks_the_tiling_and_shared_memory():
    narrow = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    assert fits(narrow, 64, 1024, 2048, 2)
    assert not fits(narrow, 64, 1000, 2048, 2)  # columns not a multiple of BLOCK_N
    assert not fits(narrow, 64, 1024, 2000, 2)  # depth not a multiple of BLOCK_K
    deep = dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)
    assert fits(deep, 64, 1024, 2048, 2) and not fits(deep, 128, 1024, 2048, 2)


@pytest.mark.parametrize("timings,expected", [
    ({CUBLAS: 6.0, 0: 3.0, 1: 2.5}, 1),  # the fastest config
    ({CUBLAS: 6.0, 0: 5.8}, CUBLAS),  # faster, but by less than MIN_GAIN
    ({CUBLAS: 6.0, 0: 9.0}, CUBLAS),
    ({CUBLAS: 6.0}, CUBLAS),  # nothing fits
])
def test_choose_keeps_cublas_unless_a_config_clearly_wins(timings, expected):
    assert choose(timings) == expected


def test_a_chain_of_pdl_launches_in_a_cuda_graph_reads_each_output_after_it_is_written(device,
                                                                                    gen):
    """norm -> matmul -> SiLU-and-mul -> matmul, eight times over, replayed as a CUDA graph with
    programmatic dependent launch: each kernel starts while the one before it runs, so a kernel
    that read before its wait would see stale values. Equal to the same chain without PDL."""
    if not on_gpu(device):
        pytest.skip("programmatic dependent launch needs a GPU")
    from dataplane.kernels import pdl
    from dataplane.kernels.rmsnorm import rms_norm
    from dataplane.kernels.silu_and_mul import silu_and_mul
    hidden, inter, rows = 1024, 3072, 64
    weights = [(randn(2 * inter, hidden, dtype=torch.bfloat16, device=device, gen=gen, scale=0.03),
                randn(hidden, inter, dtype=torch.bfloat16, device=device, gen=gen, scale=0.03))
               for _ in range(8)]
    norm_weight = torch.ones(hidden, dtype=torch.bfloat16, device=device)
    x0 = randn(rows, hidden, dtype=torch.bfloat16, device=device, gen=gen)
    up_config = next(c for c in CONFIGS if fits(c, rows, 2 * inter, hidden, 2))
    down_config = next(c for c in CONFIGS if fits(c, rows, hidden, inter, 2))

    def chain(x):
        for gate_up, down in weights:
            x = skinny_matmul(silu_and_mul(skinny_matmul(rms_norm(x, norm_weight, 1e-6), gate_up,
                                                         up_config)), down, down_config)
        return x

    results = {}
    for on in (False, True):
        pdl.set_enabled(on)
        try:
            x = x0.clone()
            chain(x)  # compiles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = chain(x)
            x.copy_(x0)
            graph.replay()
            torch.cuda.synchronize()
            results[on] = y.clone()
        finally:
            pdl.set_enabled(True)
    assert torch.isfinite(results[True]).all()
    assert torch.equal(results[True], results[False])
