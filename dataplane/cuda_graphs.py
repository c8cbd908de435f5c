"""CUDA graphs of the decode step (model forward + LM head) for a set of batch sizes.

A decode step launches a few hundred small kernels; replaying a captured graph costs one launch.
Each graph reads fixed input buffers: a step copies its inputs into the first n rows, pads the
rest of its bucket (slot -1: nothing stored; sequence length 0: nothing read) and replays the
graph of the smallest captured size >= n. Prefill and mixed steps run eagerly.
"""

import torch

from dataplane.forward_context import ForwardContext, forward_context
from dataplane.input_batch import StepInputs


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, device: torch.device) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = max_num_seqs
        i64 = dict(dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, **i64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            logits_indices=self.logits_indices[:size], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_host=None, seq_lens_host=None)

    def _forward(self, size: int) -> torch.Tensor | None:
        hidden = self.model(self.token_ids[:size], self.positions[:size])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            with forward_context(self._context(size)):
                self._forward(size)  # warm-up: kernel compilation, allocator
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def fits(self, inputs: StepInputs) -> bool:
        ctx = inputs.context
        return ctx.max_query_len == 1 and ctx.num_reqs <= self.sizes[-1]

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's logits (rank 0; None elsewhere), every request sampling one token."""
        ctx = inputs.context
        n = ctx.num_reqs
        size = next(s for s in self.sizes if s >= n)
        self.token_ids[:n] = inputs.token_ids
        self.positions[:n] = inputs.positions
        self.slot_mapping[:n] = ctx.slot_mapping
        self.slot_mapping[n:size] = -1
        self.seq_lens[:n] = ctx.seq_lens
        self.seq_lens[n:size] = 0
        self.block_tables[:n, :ctx.block_tables.shape[1]] = ctx.block_tables
        graph, logits = self.graphs[size]
        graph.replay()
        return None if logits is None else logits[:n]
