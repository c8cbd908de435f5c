"""Which kernel each linear layer runs for each decode batch size on CUDA, measured at start-up.

For every weight shape of the model's bias-free linear layers and every captured decode batch
size up to MAX_ROWS, cuBLAS and each fitting skinny_matmul config run inside a CUDA graph over
the weights of up to LAYERS_TIMED layers of that shape (as a decode step meets them: one after
another, not in L2), and the layers get the fastest, cuBLAS unless a config beats it by MIN_GAIN.
With programmatic dependent launch each skinny launch prefetches its weights while the launch
before it runs, as it does behind the norm or activation kernel before it in a decode step; the
timing sees that overlap, and cuBLAS's launches have none. The plan is fixed before the decode
graphs are captured, and timing compiles every chosen variant, so no kernel compiles inside a
served step. Each tensor-parallel rank plans its own shards.
"""

from collections.abc import Callable

import torch
from torch import nn
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from dataplane.kernels.skinny_matmul import CONFIGS, fits, skinny_matmul
from dataplane.layers.linear import _Linear

MAX_ROWS = 256  # the largest captured batch of a default server
MIN_GAIN = 0.05  # a config must be this much faster than cuBLAS (timing noise is ~1-2%)
LAYERS_TIMED = 8
REPLAYS = 10
CUBLAS = -1  # the key of cuBLAS's time among the configs' indices


def choose(timings_us: dict[int, float]) -> int:
    """The index of the config to run, or CUBLAS: the fastest, if it beats cuBLAS by MIN_GAIN."""
    best = min(timings_us, key=timings_us.get)
    return best if timings_us[best] < (1 - MIN_GAIN) * timings_us[CUBLAS] else CUBLAS


def graph_us(fn: Callable[[], object]) -> float:
    """Device microseconds of one fn() call, from replays of a CUDA graph of it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS


def _time_shape(weights: list[torch.Tensor], rows: int) -> dict[int, float]:
    """Microseconds per layer of cuBLAS (key CUBLAS) and of each fitting config (its index)."""
    num_cols, depth = weights[0].shape
    x = torch.randn(rows, depth, dtype=weights[0].dtype, device=weights[0].device)
    out = torch.empty(rows, num_cols, dtype=x.dtype, device=x.device)
    timings = {CUBLAS: graph_us(lambda: [torch.mm(x, w.t(), out=out) for w in weights])}
    for i, config in enumerate(CONFIGS):
        if not fits(config, rows, num_cols, depth, x.element_size()):
            continue
        try:  # the first, eager call compiles: a config this GPU cannot run fails there
            timings[i] = graph_us(lambda: [skinny_matmul(x, w, config, out) for w in weights])
        except (CompilationError, OutOfResources):
            continue
    return {k: us / len(weights) for k, us in timings.items()}


def plan_linear_layers(model: nn.Module, sizes: list[int]) -> dict[str, list[str]]:
    """Set gemm_plan on each bias-free bf16/fp16 linear layer for the sizes <= MAX_ROWS; returns,
    per weight shape, the sizes given to a config with its time against cuBLAS's (for the log)."""
    by_shape: dict[tuple[int, int], list[_Linear]] = {}
    for layer in model.modules():
        if isinstance(layer, _Linear) and layer.bias is None and layer.weight.is_cuda and \
                layer.weight.dtype in (torch.bfloat16, torch.float16):
            by_shape.setdefault(tuple(layer.weight.shape), []).append(layer)
    report = {}
    for shape, layers in by_shape.items():
        weights = [layer.weight for layer in layers[:LAYERS_TIMED]]
        plan, lines = {}, []
        for rows in (s for s in sizes if s <= MAX_ROWS):
            timings = _time_shape(weights, rows)
            choice = choose(timings)
            if choice != CUBLAS:
                plan[rows] = CONFIGS[choice]
                lines.append(f"{rows}: {timings[choice]:.1f} us (cuBLAS {timings[CUBLAS]:.1f})")
        for layer in layers:
            layer.gemm_plan = plan
        report[f"{shape[0]}x{shape[1]}"] = lines
    return report
