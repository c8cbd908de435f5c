"""What the paged attention launchers share (no kernel here): the checks on q and the paged KV
cache, and a launch prepared once a forward for every layer."""

from dataclasses import dataclass

import torch


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


@dataclass(frozen=True)
class PagedLaunch:
    """A paged attention kernel's launch, checked and sized once a forward (its grid, tile sizes,
    strides and the step's metadata) and run by every layer. The layers differ only in the
    kernel's first four arguments (q, k_cache, v_cache, out), which each call checks against
    the layouts it was prepared for: a prompt step between its graph pieces paid 28-36 us of
    Python a layer (CPU-measured) to redo the rest."""

    kernel: object  # a @triton.jit function
    grid: tuple[int, ...]
    rest: tuple  # the kernel's arguments after (q, k_cache, v_cache, out)
    constexprs: dict
    layouts: tuple  # q's, k_cache's, v_cache's and out's (shape, stride, dtype)

    @classmethod
    def prepare(cls, kernel: object, grid: tuple[int, ...], q: torch.Tensor,
                k_cache: torch.Tensor, out: torch.Tensor, rest: tuple,
                constexprs: dict) -> "PagedLaunch":
        cache = _layout(k_cache)
        return cls(kernel, grid, rest, constexprs, (_layout(q), cache, cache, _layout(out)))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        assert (_layout(q), _layout(k_cache), _layout(v_cache), _layout(out)) == self.layouts, \
            "a layer's q, cache or out differs from the one the launch was prepared for"
        self.kernel[self.grid](q, k_cache, v_cache, out, *self.rest, **self.constexprs)
        return out
