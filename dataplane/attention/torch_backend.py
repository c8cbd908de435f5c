"""The reference backend: a paged gather per request and SDPA. Runs anywhere; CI uses it on CPU.

Slow by design (one SDPA call per request): it is the oracle the kernels are tested against.
"""

import torch
import torch.nn.functional as F

from dataplane.forward_context import ForwardContext


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's k/v at its slot (slot = block_id * block_size + offset)."""
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` tokens of one request's paged cache: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


class TorchAttention:
    name = "torch"
    block_size: int | None = None  # any
    preferred_block_size = 16

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: ForwardContext, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        starts = ctx.query_start_loc_host
        for i, seq_len in enumerate(ctx.seq_lens_host):
            start, end = starts[i], starts[i + 1]
            keys = gather_kv(k_cache, ctx.block_tables[i], seq_len)
            values = gather_kv(v_cache, ctx.block_tables[i], seq_len)
            out[start:end] = _causal_sdpa(q[start:end], keys, values, scale)
        return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, heads, d] are the last q_len of the k_len positions of k/v: [k_len, kv_heads, d]."""
    q_len, k_len = q.shape[0], k.shape[0]
    query_pos = torch.arange(k_len - q_len, k_len, device=q.device)
    mask = torch.arange(k_len, device=q.device)[None, :] <= query_pos[:, None]  # [q_len, k_len]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [q_len, heads, d]
