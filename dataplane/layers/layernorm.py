import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, optionally fused with the residual add that precedes it.

    On CUDA tensors one Triton kernel does the work, and the fused form works in place: x is
    overwritten with the normalized output and residual with x + residual (callers hand over
    both; the model never reads them again). There x may also be float32 partial sums [parts,
    num_tokens, hidden] (a RowParallelLinear built with feeds_norm), summed as they are loaded;
    the normalized output is then a new tensor. Elsewhere the torch code below runs.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            return self._forward_triton(x, residual)
        dtype = x.dtype
        if residual is None:
            return self._norm(x.float(), dtype)
        x = x + residual
        return self._norm(x.float(), dtype), x

    def _forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from dataplane.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_parts, rms_norm
        if x.dim() == 3:  # a split-K GEMM's partial sums
            assert x.dtype == torch.float32 and residual is not None, \
                "partial sums: float32, and only from a residual branch"
            return fused_add_rms_norm_parts(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
