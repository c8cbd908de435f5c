"""RMSNorm in float32, optionally fused with the residual add that precedes it.

Memory-bound and on the decode path twice per layer (plus q/k norms): the torch version runs ~7
kernels that each read and write the activations; this is one pass. Rounding follows the torch
code of dataplane/layers/layernorm.py: the sum x + residual is rounded to the activation dtype
(that is the new residual), the normalized value is rounded before the weight multiply.
"""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_rows", "rows_per_outer", "num_cols"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, out_ptr, weight_ptr,
    num_rows, rows_per_outer, num_cols, eps,
    stride_x_outer, stride_x_inner, stride_res_row, stride_out_outer, stride_out_inner,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    outer = (rows // rows_per_outer).to(tl.int64)
    inner = rows % rows_per_outer
    x_offs = (outer * stride_x_outer + inner * stride_x_inner)[:, None] + cols[None, :]
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
    out_offs = (outer * stride_out_outer + inner * stride_out_inner)[:, None] + cols[None, :]
    tl.store(out_ptr + out_offs, (normed * weight[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
            weight: torch.Tensor, eps: float) -> None:
    num_cols = x.shape[-1]
    assert weight.shape == (num_cols,) and weight.is_contiguous()
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == x.shape
    assert x.dim() in (2, 3), "x: [num_tokens, hidden] or [num_tokens, num_heads, head_dim]"
    num_rows = x.numel() // num_cols
    if num_rows == 0:
        return
    x3, out3 = (x, out) if x.dim() == 3 else (x.unsqueeze(1), out.unsqueeze(1))
    block_cols = triton.next_power_of_2(num_cols)
    block_rows = max(1, 1024 // block_cols)  # a row (or 8 head rows) a program: a decode batch
    # of 256 tokens still spreads over every SM
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x, residual if residual is not None else x, out, weight,
        num_rows, x3.shape[1], num_cols, eps,
        x3.stride(0), x3.stride(1), residual.stride(0) if residual is not None else 0,
        out3.stride(0), out3.stride(1),
        HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=min(16, max(4, block_rows * block_cols // 512)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, hidden] or [num_tokens, num_heads, head_dim] (rows may be strided, e.g.
    the q or k part of the fused QKV output). Returns out, by default a new contiguous tensor."""
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
