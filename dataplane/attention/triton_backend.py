"""Our own Triton kernels: persistent decode attention for the requests that bring one token,
the varlen paged prefill kernel for the rest. In a step that mixes them, the leading one-token
requests (ctx.num_decodes) go to the decode kernel: in the prefill kernel each would occupy a
whole tile of query rows to use one of them.

The first attention layer of each forward prepares the step's launches (`_StepLaunches`, kept in
ctx.attention_plan) and every layer runs them on its own cache. Decode is CUDA-graph
capturable: its tile list (`plan_decode`) is built on the device, its sizes depend only on the
batch size and the block-table width, and nothing is read back on the host.

TritonFa4Attention (the triton_fa4 backend) is this one with FlashAttention-4's paged forward for
the prompt rows of steps that bring at least `fa4_min_rows` of them, in float16 or bfloat16,
unless every prompt of the step is short (fa4_paged_prefill_fits). On Hopper FA4 loads the keys
of 128-token blocks through TMA and gathers those of other block sizes with cp.async.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dataplane.attention.flash_attn_backend import Fa4PagedPrefill, fa4_paged_prefill_fits
from dataplane.forward_context import ForwardContext
from dataplane.kernels.paged_decode_attention import plan_decode, prepare_decode_attention
from dataplane.kernels.paged_inputs import PagedLaunch
from dataplane.kernels.paged_prefill_attention import prepare_prefill_attention


@dataclass(frozen=True)
class _StepLaunches:
    """A forward's attention launches, prepared by its first layer for q and out laid out as
    that layer's: the leading num_decodes rows through `decode`, the rest through `prefill`.
    q and out are kept with their slices: between a prompt step's graph pieces every layer
    attends from the same buffers (MixedGraphs), so the slices are taken once a forward."""

    num_decodes: int
    scale: float
    decode: PagedLaunch | None
    prefill: PagedLaunch | Fa4PagedPrefill | None
    q: torch.Tensor
    out: torch.Tensor
    q_parts: tuple[torch.Tensor, torch.Tensor]
    out_parts: tuple[torch.Tensor, torch.Tensor]

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, scale: float) -> None:
        assert scale == self.scale, "the step's launches were prepared for another scale"
        if self.prefill is None:  # a decode step: every row through the decode kernel
            if self.decode is not None:
                self.decode(q, k_cache, v_cache, out)
            return
        if q is self.q and out is self.out:
            (q_decodes, q_rest), (out_decodes, out_rest) = self.q_parts, self.out_parts
        else:
            (q_decodes, q_rest), (out_decodes, out_rest) = _split(q, out, self.num_decodes)
        if self.decode is not None:
            self.decode(q_decodes, k_cache, v_cache, out_decodes)
        self.prefill(q_rest, k_cache, v_cache, out_rest)


def _split(q: torch.Tensor, out: torch.Tensor, num_decodes: int) -> tuple[tuple, tuple]:
    return (q[:num_decodes], q[num_decodes:]), (out[:num_decodes], out[num_decodes:])


class TritonAttention:
    name = "triton"
    block_size: int | None = None  # any power of two
    preferred_block_size = 16

    def __init__(self, num_programs: int | None = None) -> None:
        """num_programs: decode programs per kv head; None: as many as fill the GPU once."""
        self.num_programs = num_programs

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: ForwardContext, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        if ctx.attention_plan is None:
            ctx.attention_plan = self._prepare(q, k_cache, v_cache, out, ctx, scale)
        assert isinstance(ctx.attention_plan, _StepLaunches)
        ctx.attention_plan(q, k_cache, v_cache, out, scale)
        return out

    def _prepare(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, ctx: ForwardContext, scale: float) -> _StepLaunches:
        """The step's launches: all rows through the decode kernel when each request brings one
        token, else the leading one-token requests (ctx.num_decodes) through it and the rest
        through the prefill kernel."""
        is_decode = ctx.max_query_len == 1 and q.shape[0] == ctx.seq_lens.shape[0]
        n = q.shape[0] if is_decode else ctx.num_decodes
        q_parts, out_parts = _split(q, out, n)
        decode = prefill = None
        if n:
            plan = plan_decode(q_parts[0], k_cache, ctx.block_tables[:n], ctx.seq_lens[:n],
                               num_programs=self.num_programs)
            decode = prepare_decode_attention(q_parts[0], k_cache, v_cache, out_parts[0], plan,
                                              scale)
        if not is_decode:
            prefill = self._prepare_prefill(q_parts[1], k_cache, v_cache, out_parts[1], ctx,
                                            scale, n)
        return _StepLaunches(n, scale, decode, prefill, q, out, q_parts, out_parts)

    def _prepare_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor, ctx: ForwardContext, scale: float,
                         num_decodes: int) -> PagedLaunch | Fa4PagedPrefill:
        """The launch for the rows after the leading num_decodes (q and out hold only those):
        our prefill kernel's here; TritonFa4Attention may hand them to FA4."""
        n = num_decodes
        return prepare_prefill_attention(
            q, k_cache, v_cache, out, ctx.block_tables[n:], ctx.query_start_loc[n:],
            ctx.seq_lens[n:], scale, max_query_len=ctx.max_query_len, first_token=n)


class TritonFa4Attention(TritonAttention):
    """Our kernels, but FlashAttention-4's paged forward for the prompt rows of a step that
    brings at least fa4_min_rows of them (after its leading one-token requests), in float16 or
    bfloat16 (FA4's dtypes: a float32 model runs our prefill kernel throughout), unless every
    prompt part of the step is short (flash_attn_backend.fa4_paged_prefill_fits)."""

    name = "triton_fa4"
    # Any block size (FA4 reads 128-token pages by TMA, gathers others by cp.async); 128 by
    # measurement (_best_gpu_backend): there workload A ran 0.4-0.9% faster than on
    # `triton`, on 16-token blocks no faster; smaller blocks share cached prefixes finer.
    preferred_block_size = 128

    def __init__(self, fa4_forward_into: Callable, fa4_min_rows: int,
                 num_programs: int | None = None) -> None:
        """fa4_forward_into: flash_attn_backend.fa4_forward_into()'s function."""
        super().__init__(num_programs)
        self.fa4_forward_into, self.fa4_min_rows = fa4_forward_into, fa4_min_rows

    def _prepare_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: torch.Tensor, ctx: ForwardContext, scale: float,
                         num_decodes: int) -> PagedLaunch | Fa4PagedPrefill:
        """FA4 only where the step's host offsets exist (eager steps, and prompt steps between
        their graph pieces): it sizes its grid on the host."""
        n = num_decodes
        if not self._fa4_takes(q, k_cache, ctx, n):
            return super()._prepare_prefill(q, k_cache, v_cache, out, ctx, scale, n)
        # the rows after the leading one-token requests start at row n: their offsets from 0
        return Fa4PagedPrefill(self.fa4_forward_into, ctx.query_start_loc[n:] - n,
                               ctx.seq_lens[n:], ctx.block_tables[n:], ctx.max_query_len,
                               ctx.max_seq_len, scale)

    def _fa4_takes(self, q: torch.Tensor, k_cache: torch.Tensor, ctx: ForwardContext,
                   num_decodes: int) -> bool:
        """q: the rows after the leading num_decodes."""
        starts = ctx.query_start_loc_host
        return bool(starts) and starts[-1] - num_decodes >= self.fa4_min_rows and \
            fa4_paged_prefill_fits(q, k_cache, ctx.max_query_len)
