"""Programmatic dependent launch (PDL; Hopper and later), shared by the kernels (no kernel here).

Between two dependent kernels of a stream the device normally drains the first grid, flushes its
writes and only then launches the second: a gap of a microsecond or two per kernel, paid ~10
times per layer of a decode step whose kernels each run for a few microseconds. A kernel
launched with PDL may instead be launched while the kernel before it is still running: its
programs start, then wait (griddepcontrol.wait) until that kernel has completed and its writes
are visible, so they read nothing early. Each of our kernels, once past the wait, lets the kernel
after it launch (griddepcontrol.launch_dependents). CUDA graphs keep these edges.

Every kernel launched with PDL must call `wait_for_inputs` before its first load or store: the
wait is what keeps it from reading its inputs (or overwriting memory the previous kernel still
reads) before they are ready. Kernels that do not (torch's, cuBLAS's) are launched as usual and
start after the previous kernel completes, PDL or not.

On by default where the device supports it; `ModelRunner.load` sets it from
`RunnerConfig.pdl` once, before any kernel compiles (a process-wide setting, like torch's
`torch.backends` flags; the kernel variants differ, so it is not flipped while serving).
"""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as triton_cuda

_enabled = True


def set_enabled(enabled: bool) -> None:
    """Whether kernels launched from now on use PDL where the device supports it."""
    global _enabled
    _enabled = enabled


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The kernel arguments that turn PDL on or off for a launch on `device`: the kernel's
    USE_PDL constexpr and Triton's `launch_pdl` option, always set together."""
    on = _enabled and device.type == "cuda" and _supported(
        device.index if device.index is not None else torch.cuda.current_device())
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Wait until the previous kernel's writes are visible, then let the next kernel launch.
    A no-op without PDL. Call it before the kernel's first memory access."""
    if USE_PDL:
        triton_cuda.gdc_wait()
        triton_cuda.gdc_launch_dependents()
