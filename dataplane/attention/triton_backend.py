"""Our own Triton kernels: persistent decode attention for the requests that bring one token,
the varlen paged prefill kernel for the rest. In a step that mixes them, the leading one-token
requests (ctx.num_decodes) go to the decode kernel: in the prefill kernel each would occupy a
whole tile of query rows to use one of them.

Decode is CUDA-graph capturable: its tile list (`plan_decode`) is built on the device by the
first layer of each forward and shared by the rest through ctx.attention_plan; its sizes depend
only on the batch size and the block-table width, and nothing is read back on the host.
"""

import torch

from dataplane.forward_context import ForwardContext
from dataplane.kernels.paged_decode_attention import (DecodePlan, paged_decode_attention,
                                                      plan_decode)
from dataplane.kernels.paged_prefill_attention import paged_prefill_attention


class TritonAttention:
    name = "triton"
    block_size: int | None = None  # any power of two

    def __init__(self, num_programs: int | None = None) -> None:
        """num_programs: decode programs per kv head; None: as many as fill the GPU once."""
        self.num_programs = num_programs

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: ForwardContext, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if ctx.max_query_len == 1 and q.shape[0] == ctx.seq_lens.shape[0]:
            return paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                                          scale, out=out, plan=self._plan(q, k_cache, ctx))
        num_decodes = ctx.num_decodes  # served by the decode kernel, the rest by the prefill one
        out = torch.empty_like(q) if out is None else out
        if num_decodes:
            decodes = q[:num_decodes]
            paged_decode_attention(decodes, k_cache, v_cache, ctx.block_tables[:num_decodes],
                                   ctx.seq_lens[:num_decodes], scale, out=out[:num_decodes],
                                   plan=self._plan(decodes, k_cache, ctx))
        paged_prefill_attention(q[num_decodes:], k_cache, v_cache,
                                ctx.block_tables[num_decodes:],
                                ctx.query_start_loc[num_decodes:], ctx.seq_lens[num_decodes:],
                                scale, max_query_len=ctx.max_query_len, out=out[num_decodes:],
                                first_token=num_decodes)
        return out

    def _plan(self, decodes: torch.Tensor, k_cache: torch.Tensor,
              ctx: ForwardContext) -> DecodePlan:
        """The tile list of the step's leading decodes: built once a forward, by its first layer."""
        if ctx.attention_plan is None:
            n = decodes.shape[0]
            ctx.attention_plan = plan_decode(decodes, k_cache, ctx.block_tables[:n],
                                             ctx.seq_lens[:n], num_programs=self.num_programs)
        assert isinstance(ctx.attention_plan, DecodePlan)
        return ctx.attention_plan
