"""silu(gate) * up over the merged [gate | up] projection output, in one pass.

Rounding follows torch on the activation dtype: silu is computed in float32 and rounded, then
multiplied by up in float32 and rounded.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.pdl import launch_options, wait_for_inputs
from dataplane.kernels.sizes import cdiv, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x_tok, stride_out_tok,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + token * stride_x_tok + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_x_tok + width + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_out_tok + cols,
             (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, 2 * width] -> out: [num_tokens, width]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1
    num_tokens, width = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, width) and out.dtype == x.dtype and out.stride(1) == 1
    if num_tokens == 0:
        return out
    block = min(1024, next_power_of_2(width))  # 3072 and 12288 split evenly
    _silu_and_mul_kernel[(num_tokens, cdiv(width, block))](
        x, out, width, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        **launch_options(x.device, num_tokens))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
