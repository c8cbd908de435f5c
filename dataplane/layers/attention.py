import torch
from torch import nn

from dataplane.attention import AttentionBackend
from dataplane.forward_context import ForwardContext, get_forward_context
from dataplane.layers.layernorm import RMSNorm


class Attention(nn.Module):
    """Paged attention over this rank's heads. The KV cache views are bound after allocation
    (`bind_kv_cache`), so the layer itself holds no memory until then."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend | None = None
        self.k_cache = self.v_cache = torch.empty(0)
        self.is_first_layer = False

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      backend: AttentionBackend, is_first_layer: bool = False) -> None:
        """is_first_layer: this layer starts every forward, so it drops the context's attention
        plan for the backend to rebuild (see ForwardContext.attention_plan)."""
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend
        self.is_first_layer = is_first_layer

    def _context(self) -> ForwardContext:
        assert self.backend is not None, "bind_kv_cache() before the first forward"
        ctx = get_forward_context()
        if self.is_first_layer:
            ctx.attention_plan = None
        return ctx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k and v at the step's slots (our Triton kernel on CUDA, torch elsewhere), then
        attend over the cache."""
        ctx = self._context()
        if q.is_cuda:
            from dataplane.kernels.store_kv import store_kv
        else:
            from dataplane.attention.torch_backend import store_kv
        store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return self.backend.forward(q, self.k_cache, self.v_cache, ctx, self.scale)

    def forward_qk_norm_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                             cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """CUDA only: per-head RMSNorm of q and k, RoPE, and the store of k and v at the step's
        slots in one kernel (Qwen3's attention prologue), then attention over the cache, or,
        while a piecewise graph is captured, what the context's split_at_attention returns."""
        from dataplane.kernels.qk_norm_rope import qk_norm_rope_store
        ctx = self._context()
        q = qk_norm_rope_store(positions, q, k, v, q_norm.weight, k_norm.weight, q_norm.eps,
                               cos_sin_cache, self.k_cache, self.v_cache, ctx.slot_mapping,
                               q_out=ctx.split_queries)
        if ctx.split_at_attention is not None:  # capturing a piecewise graph: attend later
            return ctx.split_at_attention(self, q)
        return self.backend.forward(q, self.k_cache, self.v_cache, ctx, self.scale)

    def attend(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention alone, its k/v already stored: what a piecewise graph's replay runs
        eagerly between two pieces (into `out`, the buffer the next piece reads)."""
        return self.backend.forward(q, self.k_cache, self.v_cache, self._context(), self.scale,
                                    out=out)
