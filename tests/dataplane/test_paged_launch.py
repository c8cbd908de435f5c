"""PagedLaunch's choice between Triton's launch and the compiled kernel's, with a stand-in for
a @triton.jit kernel (a unit test: no device, no compiler; the GPU kernel tests launch the real
ones both ways, and test_attention_backends checks the arguments against Triton's binder)."""

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.compiler import CompiledKernel  # noqa: E402

from dataplane.kernels.paged_inputs import PagedLaunch  # noqa: E402


def _kernel_signature(q, k_cache, v_cache, out, lens, num_reqs, SCALE: float = 2.0,
                      BLOCK: int = 16):
    """The parameters of the stand-in kernel."""


class _Compiled(CompiledKernel):
    """A compiled kernel whose launcher records its arguments and reads three grid sizes, as
    Triton 3.6's does (CompiledKernel.__getitem__)."""

    def __init__(self, calls: list) -> None:  # CompiledKernel's own takes a compiled binary
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("direct", (grid[0], grid[1], grid[2]), args))


class _Kernel:
    """What PagedLaunch uses of a @triton.jit function: `kernel[grid](...)`, which compiles or
    finds the compiled kernel and returns it, and `signature`."""

    signature = inspect.signature(_kernel_signature)

    def __init__(self) -> None:
        self.calls: list = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return _Compiled(self.calls)
        return launch


def _tensors(offset: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache and out; their pointers `offset` float32s past 16-byte alignment."""
    def make(*shape):
        return torch.zeros(offset + torch.Size(shape).numel())[offset:].view(shape)
    return make(3, 4, 16), make(5, 4, 2, 16), make(5, 4, 2, 16), make(3, 4, 16)


def test_layers_after_the_first_launch_the_compiled_kernel():
    kernel, lens = _Kernel(), torch.ones(3, dtype=torch.int32)
    first, second = _tensors(), _tensors()
    launch = PagedLaunch.prepare(kernel, (2, 3), first[0], first[1], first[3], (lens, 3),
                                 dict(BLOCK=32, num_warps=4))
    launch(*first)
    launch(*second)
    assert kernel.calls[0] == ("triton", (2, 3), (*first, lens, 3), dict(BLOCK=32, num_warps=4))
    # the kernel's order, its defaults filled in, Triton's launch options left out
    assert kernel.calls[1] == ("direct", (2, 3, 1), (*second, lens, 3, 2.0, 32))


def test_pointers_not_all_aligned_go_through_triton():
    """Triton specializes a pointer on 16-byte alignment: a call whose pointers are not all
    aligned may need another compiled kernel, which Triton picks. The kernel launched directly
    is the one Triton returned for the first call whose pointers all were."""
    aligned, misaligned = _tensors(), _tensors(offset=1)
    for order, expected in [((aligned, misaligned, aligned), ["triton", "triton", "direct"]),
                            ((misaligned, aligned, aligned), ["triton", "triton", "direct"])]:
        kernel = _Kernel()
        first = order[0]
        launch = PagedLaunch.prepare(kernel, (1,), first[0], first[1], first[3], (None, 1), {})
        for tensors in order:
            launch(*tensors)
        assert [call[0] for call in kernel.calls] == expected


def test_other_triton_versions_always_go_through_triton(monkeypatch):
    """The compiled kernel's argument convention was read from Triton 3.6 (older ones leave the
    constexprs out): another version keeps Triton's launch."""
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    kernel, tensors = _Kernel(), _tensors()
    launch = PagedLaunch.prepare(kernel, (1,), tensors[0], tensors[1], tensors[3], (None, 1), {})
    launch(*tensors)
    launch(*tensors)
    assert [call[0] for call in kernel.calls] == ["triton", "triton"]
