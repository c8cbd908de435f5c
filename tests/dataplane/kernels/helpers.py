"""Shared pieces of the kernel tests: where they run, tolerances, paged-cache builders.

The tests run on CUDA when there is a device (marked `gpu`, skipped without one), or on CPU
tensors under Triton's interpreter when TRITON_INTERPRET=1 (then they are not marked `gpu`).
The interpreter cannot check bfloat16: its tl.dot multiplies the raw bf16 bit patterns and its
float32 -> bf16 casts truncate, so bf16 cases run on the GPU only. (Triton 3.6's interpreter
also needs numpy < 2.4: it converts 1-element arrays to ints, which numpy 2.4 refuses.)

    TRITON_INTERPRET=1 python -m pytest tests/dataplane/kernels     # CPU, interpreter
    python -m pytest tests/dataplane/kernels                        # on a CUDA machine
"""

import math
import os
from dataclasses import dataclass

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# GPU tests unless the interpreter runs them on CPU.
KERNEL_MARKS = [] if INTERPRET else [pytest.mark.gpu]

# (atol, rtol) against the float32 torch reference rounded to the same dtype: one rounding of the
# output plus, for attention, P rounded to the input dtype before the PV product.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def kernel_device() -> torch.device:
    if INTERPRET:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 to run on CPU under Triton's interpreter")


def skip_unsupported(dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter does not emulate bf16 dots and rounding")


def on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert torch.isfinite(actual).all(), "non-finite output (an element left unwritten?)"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedCache:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    trap_block: int  # a NaN-filled block that every unused block-table entry points at


def make_paged_cache(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                     poison_tails: bool = True) -> PagedCache:
    """Random K/V for each request's first seq_len tokens in shuffled blocks. Everything a kernel
    must not read is NaN: unused blocks, the trap block behind unused block-table entries and,
    with poison_tails, the slots past seq_len in each request's last block."""
    blocks_per_req = [math.ceil(n / block_size) for n in seq_lens]
    num_used = sum(blocks_per_req)
    num_blocks = num_used + 3  # two spare blocks and the trap
    trap = num_blocks - 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=gen)[:num_used]
    width = max(blocks_per_req, default=0) + 2
    block_tables = torch.full((len(seq_lens), width), trap, dtype=torch.int32)
    used = 0
    for i, (seq_len, count) in enumerate(zip(seq_lens, blocks_per_req)):
        ids = order[used:used + count]
        used += count
        block_tables[i, :count] = ids.int()
        tokens = torch.randn(count * block_size, 2, num_kv_heads, head_dim, generator=gen)
        if poison_tails:
            tokens[seq_len:] = float("nan")
        k_cache[ids] = tokens[:, 0].view(count, block_size, num_kv_heads, head_dim).to(dtype)
        v_cache[ids] = tokens[:, 1].view(count, block_size, num_kv_heads, head_dim).to(dtype)
    return PagedCache(k_cache.to(device), v_cache.to(device), block_tables.to(device), trap)


def randn(*shape: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator,
          scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def gemm_operands(num_rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                  gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [num_rows, k] and a layer-scaled weight w [n, k]. The interpreter is slow: there, shapes
    above 128 x 256 run at up to 7 rows only (the rest skip)."""
    if device.type == "cpu" and n * k > 128 * 256 and num_rows > 7:
        pytest.skip("the interpreter is slow: the large shapes at 1 and 7 rows only")
    return (randn(num_rows, k, dtype=dtype, device=device, gen=gen),
            randn(n, k, dtype=dtype, device=device, gen=gen, scale=k ** -0.5))


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def counted(fn, calls: list):
    """fn, noting each call in `calls`: whether a path ran at all (FA4 behind a backend)."""
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapper


def cumsum0(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
