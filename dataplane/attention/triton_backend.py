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
            return paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                                          scale, num_splits=self.num_splits,
                                          max_seq_len=ctx.max_seq_len)
        num_decodes = ctx.num_decodes  # served by the decode kernel, the rest by the prefill one
        out = torch.empty_like(q)
        if num_decodes:
            paged_decode_attention(q[:num_decodes], k_cache, v_cache,
                                   ctx.block_tables[:num_decodes], ctx.seq_lens[:num_decodes],
                                   scale, num_splits=self.num_splits,
                                   max_seq_len=ctx.max_decode_seq_len, out=out[:num_decodes])
        paged_prefill_attention(q[num_decodes:], k_cache, v_cache,
                                ctx.block_tables[num_decodes:],
                                ctx.query_start_loc[num_decodes:], ctx.seq_lens[num_decodes:],
                                scale, max_query_len=ctx.max_query_len, out=out[num_decodes:],
                                first_token=num_decodes)
        return out
