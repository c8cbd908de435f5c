import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up for the merged [gate | up] projection output (one Triton kernel on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from dataplane.kernels.silu_and_mul import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return F.silu(gate) * up
