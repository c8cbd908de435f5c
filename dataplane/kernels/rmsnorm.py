"""RMSNorm in float32, optionally fused with the residual add that precedes it.

Memory-bound and on the decode path twice per layer: the torch version runs ~7
kernels that each read and write the activations; this is one pass. Rounding follows the torch
code of dataplane/layers/layernorm.py: the sum x + residual is rounded to the activation dtype
(that is the new residual), the normalized value is rounded before the weight multiply.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.pdl import launch_options, wait_for_inputs
from dataplane.kernels.sizes import cdiv, next_power_of_2


# num_cols (the hidden size, one value per model) stays specialized: knowing it divides by 16
# lets the column mask allow 16-byte loads; unspecialized, every load was 2 bytes and a
# 16k-token prefill's norm ran at a third of the copy bandwidth (97 us for 128 MB on the H200).
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, out_ptr, weight_ptr,
    num_rows, num_cols, eps, stride_x_row, stride_res_row, stride_out_row,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    PARTS: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    x_offs = (rows.to(tl.int64) * stride_x_row)[:, None] + cols[None, :]
    if PARTS:  # x: float32 partial sums [PARTS, num_rows, num_cols], rounded like a GEMM's out
        x = tl.zeros([BLOCK_ROWS, BLOCK_COLS], tl.float32)
        for part in tl.static_range(PARTS):
            x += tl.load(x_ptr + part * num_rows * num_cols + x_offs, mask=mask, other=0.0)
        x = x.to(residual_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_offs = (rows.to(tl.int64) * stride_res_row)[:, None] + cols[None, :]
        total = (x + tl.load(residual_ptr + res_offs, mask=mask, other=0.0).to(tl.float32))
        total = total.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + res_offs, total, mask=mask)
        x = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / num_cols + eps)  # [BLOCK_ROWS]
    normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
    out_offs = (rows.to(tl.int64) * stride_out_row)[:, None] + cols[None, :]
    tl.store(out_ptr + out_offs, (normed * weight[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
            weight: torch.Tensor, eps: float, parts: int = 0) -> None:
    num_rows, num_cols = x.shape[-2:]
    assert weight.shape == (num_cols,) and weight.is_contiguous()
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == x.shape[-2:]
    if num_rows == 0:
        return
    block_cols = next_power_of_2(num_cols)
    block_rows = max(1, 1024 // block_cols)  # a row a program at hidden sizes >= 1024: a
    # decode batch of 256 tokens still spreads over every SM
    _rms_norm_kernel[(cdiv(num_rows, block_rows),)](
        x, residual if residual is not None else x, out, weight, num_rows, num_cols, eps,
        x.stride(-2), residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        PARTS=parts,
        num_warps=min(16, max(4, block_rows * block_cols // 512)),
        **launch_options(x.device, num_rows),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, hidden] (rows may be strided). Returns out, by default a new contiguous
    tensor."""
    assert x.dim() == 2, "x: [num_tokens, hidden]"
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.dtype == x.dtype
    _launch(x, None, out, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual). x, residual: [num_tokens,
    hidden] with contiguous rows. Returns (x, residual)."""
    assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
    assert residual.stride(-1) == 1
    _launch(x, residual, x, weight, eps)
    return x, residual


def fused_add_rms_norm_parts(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- sum(parts) + residual in place; returns (rms_norm(residual), residual).
    parts: float32 [num_parts, num_tokens, hidden] contiguous (splitk_matmul's partials), their
    sum rounded to the residual's dtype as the GEMM it replaces would have rounded it."""
    assert parts.dim() == 3 and parts.is_contiguous() and parts.dtype == torch.float32
    assert residual.shape == parts.shape[1:] and residual.stride(-1) == 1
    assert parts.numel() < 2 ** 31, "the kernel's part offsets are int32"
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    _launch(parts, residual, out, weight, eps, parts=parts.shape[0])
    return out, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch code the model runs on CPU; with a residual returns (normed, x + residual)."""
    dtype = x.dtype
    if residual is not None:
        x = x + residual
        residual = x
    x = x.float()
    normed = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return normed if residual is None else (normed, residual)
