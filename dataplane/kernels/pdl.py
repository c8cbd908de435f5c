"""Programmatic dependent launch (PDL; Hopper and later), shared by the kernels (no kernel here).

Between two dependent kernels of a stream the device normally drains the first grid, flushes its
writes and only then launches the second: a microsecond or two per boundary, paid ~8 times a
layer of a decode step whose kernels each run for a few microseconds. A kernel launched with PDL
may start while the kernel before it is still running: its programs do what needs nothing from
that kernel (a GEMM asks the L2 for its weights), then wait (griddepcontrol.wait) until that
kernel has completed and its writes are visible. CUDA graphs keep these edges.

Every kernel launched with PDL calls `wait_for_inputs` before its first access to memory that
another kernel writes or reads (weights excepted): the wait is what keeps it from reading its
inputs, or overwriting what the previous kernel still reads, too early. Only after its own wait
does a kernel let the next one launch, so the next one's wait also covers every kernel before.
Kernels that do not take part (torch's, cuBLAS's) launch as usual and start after the previous
kernel completes, PDL or not.

History: PDL on every Triton kernel alone did not pay (sixth session, 269b2ac: in a decode step
nearly every Triton kernel followed a cuBLAS GEMM, launched without it). It is back with decode
GEMMs of our own (decode_matmul.py, splitk_matmul.py), so that at decode batch sizes a layer's
kernels are all ours.

On by default where the device supports it; `ModelRunner.load` sets it from `RunnerConfig.pdl`
once, before any kernel compiles (a process-wide setting, like torch's `torch.backends` flags).
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as triton_cuda

from dataplane.kernels.sizes import next_power_of_2

_enabled = True
# Launches of more rows (tokens, requests) than this go without PDL. On the H200 at 865485f and
# 9290a2a (bench-0.6b against bench-0.6b-nopdl, twice) PDL took 0.9-5.8% off the decode steps of
# up to 128 rows but added 0.3-0.8% to those of 129-256, where cuBLAS runs every GEMM and only
# q/k-norm -> attention is a pair of ours; again at 22aaf1d (0.4-1.0%,
# qwen3-0.6b-inprocess-tp1-22aaf1d-pdl-*.json).
MAX_ROWS = 128


def set_enabled(enabled: bool) -> None:
    """Whether kernels launched from now on use PDL where the device supports it."""
    global _enabled
    _enabled = enabled


@functools.cache
def _supported(device_index: int) -> bool:
    # griddepcontrol needs Hopper; Triton's launch_pdl option and gdc_* came after torch 2.6's
    return (torch.cuda.get_device_capability(device_index)[0] >= 9
            and hasattr(triton_cuda, "gdc_wait"))


def launch_options(device: torch.device, num_rows: int) -> dict:
    """The kernel arguments that turn PDL on or off for a launch of num_rows rows on `device`:
    the kernel's USE_PDL constexpr and Triton's `launch_pdl` option, always set together (the
    option left out when off: a Triton without it refuses the keyword)."""
    on = _enabled and num_rows <= MAX_ROWS and device.type == "cuda" and _supported(
        device.index if device.index is not None else torch.cuda.current_device())
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch.
    A no-op without PDL."""
    if USE_PDL:
        triton_cuda.gdc_wait()
        triton_cuda.gdc_launch_dependents()


LINE = 128  # bytes of an L2 line


@triton.jit
def prefetch_rows(ptr, rows, stride_row, row_start, NUM_ELEMS: tl.constexpr,
                  ELEMS_PER_LINE: tl.constexpr, NUM_LINES_POW2: tl.constexpr):
    """Ask the L2 for elements [row_start, row_start + NUM_ELEMS) of each of `rows` (a weight
    strip: no registers held, nothing waited for), for the time before `wait_for_inputs`.
    ELEMS_PER_LINE, NUM_LINES_POW2: prefetch_args' values."""
    lines = tl.minimum(tl.arange(0, NUM_LINES_POW2), (NUM_ELEMS - 1) // ELEMS_PER_LINE)
    ptrs = (ptr + rows.to(tl.int64)[:, None] * stride_row + row_start
            + (lines * ELEMS_PER_LINE)[None, :])  # a repeated line is harmless
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch_args(weight: torch.Tensor, num_elems: int) -> dict:
    """The constexprs of a kernel that calls prefetch_rows for num_elems of `weight`'s rows."""
    per_line = LINE // weight.element_size()
    return {"ELEMS_PER_LINE": per_line,
            "NUM_LINES_POW2": next_power_of_2(-(-num_elems // per_line))}
