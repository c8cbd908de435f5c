"""Steps the data plane runs on itself while it is configured, never for a request: forwards of
made-up batches over the bound KV cache that stand for what served steps will launch, so that
every Triton kernel variant compiles and every cuBLAS module loads before the first real step.

A Triton compile holds the GIL for up to seconds, which would silence the link's heartbeats,
and stalls the step it happens in (a second of split mode's workload A at 127bf0b); a cuBLAS
module loaded lazily cost a 16k-token prompt step ~9 ms of host time (890cda3).
"""

import itertools
from dataclasses import dataclass, replace

import torch

from dataplane.forward_context import ForwardContext, forward_context
from dataplane.input_batch import BatchLimits
from dataplane.sampler import compile_kernels as compile_sampler_kernels


@dataclass(frozen=True)
class DummySteps:
    """Made-up steps through `model` on `device` over whatever KV cache its layers hold."""

    model: torch.nn.Module
    device: torch.device
    block_size: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype

    def _arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    def compile_kernels(self, limits: BatchLimits, num_blocks: int, backend_name: str,
                        is_rank0: bool) -> None:
        """Eager prompt steps at each power-of-two length and two eager decode steps (one long
        request, whose tiles are merged across programs; a full batch of short ones). At each
        length one step is a single prompt and one a lopsided batch, a prompt of half the tokens
        followed by one-token requests: the prefill kernel takes another grid for that layout
        (kernels/paged_prefill_attention.py), as for a mixed step's long chunk among short ones.
        (The torch backend's attention has no kernels: two short prompt steps meet the layers'
        kernels at decode sizes, which the profiling step's full batch does not: at 2 tokens the
        decode GEMMs, at 64 the split-K ones and the variants launched with PDL,
        kernels/pdl.py.) Then the LM head at every row count and, on rank 0, the sampler."""
        logits = None
        if backend_name == "torch":
            for num_tokens in sorted({2, min(64, limits.max_num_batched_tokens)}):
                logits = self.forward([num_tokens], num_blocks, 1, store=False)
        else:
            self.decode(1, limits.max_model_len, num_blocks)
            self.decode(limits.max_num_seqs, min(limits.max_model_len, 64), num_blocks)
            num_tokens = 2
            while True:
                num_tokens = min(num_tokens, limits.max_num_batched_tokens)
                half = num_tokens // 2
                self.forward([num_tokens - half] + [1] * half, num_blocks, 1, store=False,
                             max_query_len=num_tokens)
                logits = self.forward([num_tokens], num_blocks, 1, store=False)
                if num_tokens == limits.max_num_batched_tokens:
                    break
                num_tokens *= 2
        self.lm_head_at_every_row_count(limits.max_num_seqs)
        if is_rank0:
            compile_sampler_kernels(logits if logits is not None else torch.zeros(
                1, self.vocab_size, dtype=self.dtype, device=self.device))
        torch.cuda.synchronize()

    @torch.inference_mode()
    def lm_head_at_every_row_count(self, max_rows: int) -> None:
        """The LM head at every row count a step can sample (1 to max_num_seqs). Steps with
        prompt tokens run it eagerly at their own row count, and cuBLAS picks a kernel per shape
        whose module CUDA loads the first time it runs (lazy loading): on the H200 a 16k-token
        prompt step spent ~9 ms of host time in the head's F.linear for each row count it was
        the first to meet (bench/host_profile.py, stage host-profile-16k, at 890cda3)."""
        arange = self._arange
        hidden = torch.zeros(max_rows, self.hidden_size, dtype=self.dtype, device=self.device)
        ctx = ForwardContext(
            query_start_loc=arange(2).int(), seq_lens=arange(1).int(),
            slot_mapping=torch.full((1,), -1, device=self.device),
            block_tables=arange(1).int()[None], logits_indices=arange(1), max_query_len=1,
            max_seq_len=1, query_start_loc_host=None, seq_lens_host=None)
        for rows in range(1, max_rows + 1):
            with forward_context(replace(ctx, logits_indices=arange(rows))):
                self.model.compute_logits(hidden)

    @torch.inference_mode()
    def decode(self, num_reqs: int, seq_len: int, num_blocks: int) -> None:
        """An eager decode step of num_reqs requests of seq_len tokens over the bound KV cache
        (blocks reused modulo num_blocks), storing nothing."""
        arange = self._arange
        table = (arange(-(-seq_len // self.block_size)) % num_blocks).int()
        ctx = ForwardContext(
            query_start_loc=arange(num_reqs + 1).int(),
            seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_reqs,), -1, device=self.device),
            block_tables=table[None].expand(num_reqs, -1).contiguous(),
            logits_indices=arange(num_reqs), max_query_len=1, max_seq_len=seq_len,
            query_start_loc_host=list(range(num_reqs + 1)), seq_lens_host=[seq_len] * num_reqs)
        with forward_context(ctx):
            self.model.compute_logits(self.model(
                torch.zeros(num_reqs, dtype=torch.long, device=self.device),
                torch.full((num_reqs,), seq_len - 1, device=self.device)))

    @torch.inference_mode()
    def forward(self, query_lens: list[int], num_blocks: int, rows: int, store: bool = True,
                max_query_len: int | None = None) -> torch.Tensor | None:
        """A forward of prompts of query_lens tokens over the bound KV cache (every request on
        the same blocks, reused modulo num_blocks, so only a single prompt may store); store=False
        leaves the cache untouched. max_query_len: the host's bound on the query lengths
        (default: the longest). Returns the last `rows` logits (None off rank 0)."""
        assert not store or len(query_lens) == 1, "requests on shared blocks must not store"
        arange = self._arange
        num_tokens, num_reqs, longest = sum(query_lens), len(query_lens), max(query_lens)
        blocks = arange(-(-longest // self.block_size)) % num_blocks
        slots = arange(num_tokens) if store else torch.full((num_tokens,), -1, device=self.device)
        starts = [0, *itertools.accumulate(query_lens)]
        ctx = ForwardContext(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=self.device),
            slot_mapping=slots, block_tables=blocks.int()[None].expand(num_reqs, -1).contiguous(),
            logits_indices=arange(num_tokens)[-rows:], max_query_len=max_query_len or longest,
            max_seq_len=longest, query_start_loc_host=starts, seq_lens_host=list(query_lens))
        positions = arange(num_tokens) - torch.repeat_interleave(
            ctx.query_start_loc[:-1], ctx.seq_lens, output_size=num_tokens)
        with forward_context(ctx):
            hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                                positions)
            return self.model.compute_logits(hidden)
