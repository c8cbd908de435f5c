"""What the paged attention launchers share (no kernel here): the checks on q and the paged KV
cache, and a launch prepared once a forward for every layer."""

from dataclasses import dataclass, field

import torch
import triton
from triton.compiler import CompiledKernel


def check_paged_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor) -> None:
    """q: [rows, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim], same layout and dtype as q."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert num_heads % num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two >= 16"
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype


def _all_aligned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor) -> bool:
    """Whether all four pointers are 16-byte aligned: what Triton specializes a pointer argument
    on besides its dtype."""
    return (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | out.data_ptr()) % 16 == 0


# The Triton versions whose launch convention _DirectLaunch follows, read from 3.6's
# runtime/jit.py: JITFunction.run hands the compiled kernel every parameter's value, constexprs
# and defaults included, in the signature's order (older versions left the constexprs out).
DIRECT_LAUNCH_TRITON_VERSIONS = ("3.6.",)


@dataclass(frozen=True)
class _DirectLaunch:
    runner: object  # the compiled kernel's launcher for the grid: runner(*arguments)
    tail: tuple  # the kernel's arguments after q, k_cache, v_cache and out, in its order


@dataclass
class PagedLaunch:
    """A paged attention kernel's launch, checked and sized once a forward (its grid, tile sizes,
    strides and the step's metadata) and run by every layer. The layers differ only in the
    kernel's first four arguments (q, k_cache, v_cache, out), which each call checks against
    the layouts it was prepared for: a prompt step between its graph pieces paid 28-36 us of
    Python a layer (CPU-measured) to redo the rest.

    The first call launches through Triton's `kernel[grid]`, which compiles the kernel or finds
    it compiled for these arguments. When its pointers are 16-byte aligned (as a step's
    buffers and cache layers are), the calls after it whose pointers are too launch that
    compiled kernel directly (nothing else the kernel was specialized on differs between
    layers): Triton's `JITFunction.run` re-derives the specialization and the cache key from
    all ~30 arguments at every launch, part of the ~75 us a layer of the H200 host's time that
    a mixed step's two launches took in it (host_profile.py --timers)."""

    kernel: object  # a @triton.jit function
    grid: tuple[int, ...]
    rest: tuple  # the kernel's arguments after (q, k_cache, v_cache, out)
    constexprs: dict  # the kernel's constexpr arguments and Triton's launch options
    layouts: tuple  # q's, k_cache's, v_cache's and out's (shape, stride, dtype)
    _direct: _DirectLaunch | None = field(default=None, init=False, repr=False)

    @classmethod
    def prepare(cls, kernel: object, grid: tuple[int, ...], q: torch.Tensor,
                k_cache: torch.Tensor, out: torch.Tensor, rest: tuple,
                constexprs: dict) -> "PagedLaunch":
        cache = _layout(k_cache)
        return cls(kernel, grid, rest, constexprs, (_layout(q), cache, cache, _layout(out)))

    @property
    def launches_directly(self) -> bool:
        """Whether calls after the first launch the compiled kernel (not under the interpreter,
        nor on a Triton outside DIRECT_LAUNCH_TRITON_VERSIONS, nor after unaligned pointers)."""
        return self._direct is not None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        tensors = (q, k_cache, v_cache, out)
        assert tuple(map(_layout, tensors)) == self.layouts, \
            "a layer's q, cache or out differs from the one the launch was prepared for"
        direct, is_aligned = self._direct, _all_aligned(*tensors)
        if direct is not None and is_aligned:
            direct.runner(*tensors, *direct.tail)
            return out
        compiled = self.kernel[self.grid](*tensors, *self.rest, **self.constexprs)
        if direct is None and is_aligned and _is_compiled(compiled):
            # the compiled kernel's launcher reads three grid sizes; kernel[grid] pads them
            grid = (*self.grid, 1, 1)[:3]
            self._direct = _DirectLaunch(compiled[grid], self._tail(tensors))
        return out

    def _tail(self, tensors: tuple[torch.Tensor, ...]) -> tuple:
        """The kernel's arguments after `tensors` as Triton's launch hands them to the compiled
        kernel: its signature bound and completed with defaults (what JITFunction's binder
        does), Triton's launch options left out."""
        signature = self.kernel.signature
        kernel_kwargs = {k: v for k, v in self.constexprs.items() if k in signature.parameters}
        bound = signature.bind(*tensors, *self.rest, **kernel_kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())[len(tensors):]


def _is_compiled(launched: object) -> bool:
    """Whether a `kernel[grid](...)` result is a compiled kernel to launch directly (under
    Triton's interpreter it is not), from a Triton whose convention _DirectLaunch follows."""
    return (isinstance(launched, CompiledKernel)
            and triton.__version__.startswith(DIRECT_LAUNCH_TRITON_VERSIONS))
