from typing import Protocol

import torch

from dataplane.forward_context import ForwardContext


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: ForwardContext, scale: float) -> torch.Tensor:
        """Store the new k/v at `ctx.slot_mapping`, then attend causally over each request's
        cached and new tokens.

        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim].
        """
        ...


def make_backend(name: str, device: str) -> AttentionBackend:
    if name == "auto":
        name = "torch" if device == "cpu" else _best_gpu_backend()
    if name == "torch":
        from dataplane.attention.torch_backend import TorchAttention
        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r} (choose from: auto, torch)")


def _best_gpu_backend() -> str:
    return "torch"
