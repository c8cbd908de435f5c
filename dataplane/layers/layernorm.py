import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, optionally fused with the residual add that precedes it."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        dtype = x.dtype
        if residual is None:
            return self._norm(x.float(), dtype)
        x = x + residual
        return self._norm(x.float(), dtype), x
