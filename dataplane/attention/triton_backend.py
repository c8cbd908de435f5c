"""Our own Triton kernels: split-KV decode attention for the requests that bring one token, the
varlen paged prefill kernel for the rest. In a step that mixes them, the leading one-token
requests (ctx.num_decodes) go to the decode kernel: in the prefill kernel each would occupy a
whole tile of query rows to use one of them.

Decode is CUDA-graph capturable: the split count is a function of the batch size and the
context's max_seq_len, both fixed for a captured graph (capture with the largest length the
graph will see), and nothing reads a device value back on the host.
"""

import torch

from dataplane.forward_context import ForwardContext
from dataplane.kernels.paged_decode_attention import paged_decode_attention
from dataplane.kernels.paged_prefill_attention import paged_prefill_attention


class TritonAttention:
    name = "triton"
    block_size: int | None = None  # any power of two

    def __init__(self, num_splits: int | None = None) -> None:
        """num_splits: a fixed split count for decode; None picks one per launch from the batch
        size and ctx.max_seq_len."""
        self.num_splits = num_splits

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: ForwardContext, scale: float) -> torch.Tensor:
        if ctx.max_query_len == 1 and q.shape[0] == ctx.seq_lens.shape[0]:
            return self._decode(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, ctx, scale)
        d = ctx.num_decodes
        out = torch.empty_like(q)
        if d:
            self._decode(q[:d], k_cache, v_cache, ctx.block_tables[:d], ctx.seq_lens[:d], ctx,
                         scale, out=out[:d])
        paged_prefill_attention(q[d:], k_cache, v_cache, ctx.block_tables[d:],
                                ctx.query_start_loc[d:], ctx.seq_lens[d:], scale,
                                max_query_len=ctx.max_query_len, out=out[d:], first_token=d)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, ctx: ForwardContext,
                scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      num_splits=self.num_splits, max_seq_len=ctx.max_seq_len,
                                      out=out)
