"""CUDA graphs of the model's steps, so that a step costs the host a few launches instead of a
few hundred (~10 kernels a layer, each 20-40 us of Python and Triton binding when eager).

- `DecodeGraphs`: the whole decode step (model forward + LM head) for a set of batch sizes.
- `MixedGraphs`: steps that carry prompt tokens, up to MAX_MIXED_TOKENS, as *pieces* (vLLM's
  piecewise graphs): everything between two attention layers is one graph, and attention, whose
  launches depend on the batch's lengths on the host, runs eagerly between the replays.

Each graph reads fixed input buffers: a step copies its inputs into the first n rows, pads the
rest of its bucket (slot -1: nothing stored; sequence length 0: nothing read) and replays the
graphs of the smallest captured size >= n (a decode step in one kernel, `decode_inputs`, from
its staged arrays). Prompt steps above MAX_MIXED_TOKENS run eagerly.
"""

from dataclasses import fields

import torch

from dataplane.forward_context import ForwardContext, forward_context
from dataplane.input_batch import InputBatch, StagedStep, StepInputs
from dataplane.layers.attention import Attention


class StepBuffers:
    """The token inputs every captured forward reads, for up to n tokens: a step copies its
    own into the first rows; the rest of its bucket stores nothing (slot -1)."""

    def __init__(self, n: int, device: torch.device) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        self.token_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)

    def load(self, inputs: StepInputs, size: int) -> None:
        n = inputs.token_ids.shape[0]
        self.token_ids[:n] = inputs.token_ids
        self.positions[:n] = inputs.positions
        self.slot_mapping[:n] = inputs.context.slot_mapping
        self.slot_mapping[n:size] = -1


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Decode steps: the graphs read the batch's token and block tables (`InputBatch`) through
    the buffers `decode_inputs` fills before each replay."""

    def __init__(self, model: torch.nn.Module, batch: InputBatch) -> None:
        self.model = model
        self.batch = batch
        limits, device = batch.limits, batch.device
        self.sizes = capture_sizes(limits.max_num_seqs)
        self.max_model_len = limits.max_model_len
        n, max_blocks_per_seq = limits.max_num_seqs, limits.max_blocks_per_seq
        self.inputs = StepBuffers(n, device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.inputs.slot_mapping[:size], block_tables=self.block_tables[:size],
            logits_indices=self.logits_indices[:size], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_host=None, seq_lens_host=None)

    def _forward(self, size: int) -> torch.Tensor | None:
        hidden = self.model(self.inputs.token_ids[:size], self.inputs.positions[:size])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        none = torch.empty(0, dtype=torch.int64, device=self.seq_lens.device)
        self._fill(StagedStep(*[none] * len(fields(StagedStep))), self.sizes[0])  # compiles it
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
        """One token a request, every request sampling (the graphs' LM head projects every
        row: a one-token prompt chunk that does not end its prompt goes the eager way)."""
        return (inputs.max_query_len == 1 and len(inputs.sampled_slots) == inputs.num_reqs
                and inputs.num_reqs <= self.sizes[-1])

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's logits (rank 0; None elsewhere), every request sampling one token.
        inputs: staged only (`InputBatch.stage`)."""
        n = inputs.num_reqs
        size = next(s for s in self.sizes if s >= n)
        self._fill(inputs.staged, size)
        graph, logits = self.graphs[size]
        graph.replay()
        return None if logits is None else logits[:n]

    def _fill(self, s: StagedStep, size: int) -> None:
        from dataplane.kernels.decode_inputs import decode_inputs  # CUDA only: imports triton
        buffers = self.inputs
        decode_inputs(s.positions, s.token_index, s.slot_mapping, s.seq_lens, s.slots,
                      s.new_start, s.new_count, s.new_column, s.new_blocks,
                      self.batch.token_ids, self.batch.block_table_device, buffers.token_ids,
                      buffers.positions, buffers.slot_mapping, self.seq_lens,
                      self.block_tables, size, self.batch.limits.block_size)


# The largest prompt step the graphs take; the KV budget sets aside their pool (one forward's
# activations at this size). Up to 2048 until 1f5cb14, on the belief that a larger step's device
# time hides its eager host time. Workload A's 16k-token prompt steps showed otherwise on the
# H200 (in-process, 1f5cb14): the device waited 10-17 ms before each of them (~30 ms of Python
# and Triton binding for ~300 launches, next to the engine's own work on the same thread).
MAX_MIXED_TOKENS = 16384
MIXED_SIZE_STEP = 2048  # above it a size every this many tokens: a step pads by less than this


def mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 32 below MIXED_SIZE_STEP, then its multiples, then the largest step
    the graphs take (a 11.6k-token step pads to 12,288 tokens, not to 16,384)."""
    top = min(MAX_MIXED_TOKENS, max_num_batched_tokens)
    powers = [32 << i for i in range((MIXED_SIZE_STEP // 32).bit_length() - 1) if 32 << i < top]
    return powers + list(range(MIXED_SIZE_STEP, top, MIXED_SIZE_STEP)) + [top]


class MixedGraphs:
    """Steps that carry prompt tokens as per-size lists of pieces: piece i runs from layer i-1's
    attention output (the embedding, for i = 0) to layer i's queries, K/V store included; the
    last piece ends at the final norm. Between two replays the runner attends eagerly over the
    real tokens, reading the queries from `q` and writing the output to `out`, the two buffers
    every piece and size shares. The LM head and sampling stay eager (their row count varies)."""

    def __init__(self, model: torch.nn.Module, max_num_batched_tokens: int, num_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.sizes = mixed_sizes(max_num_batched_tokens)
        n = self.sizes[-1]
        self.inputs = StepBuffers(n, device)
        self.q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        self.out = torch.zeros_like(self.q)
        # size -> (pieces, the attention layer after each piece but the last, final hidden)
        self.graphs: dict[int, tuple[list[torch.cuda.CUDAGraph], list[Attention],
                                     torch.Tensor]] = {}

    @staticmethod
    def held_bytes(max_num_batched_tokens: int, hidden_size: int, num_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:
        """What the graphs hold besides one forward's activations in their pool: each size's
        final hidden state (alive for its replays) and the q/out buffers every piece shares."""
        sizes = mixed_sizes(max_num_batched_tokens)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return (sum(sizes) * hidden_size + 2 * sizes[-1] * num_heads * head_dim) * itemsize

    def _context(self, size: int, split) -> ForwardContext:
        """What the pieces read: the slots of the K/V store (attention is not captured)."""
        device = self.q.device
        return ForwardContext(
            query_start_loc=torch.tensor([0, size], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=device),
            slot_mapping=self.inputs.slot_mapping[:size],
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            logits_indices=self.inputs.token_ids[:0], max_query_len=size, max_seq_len=size,
            query_start_loc_host=None, seq_lens_host=None, split_at_attention=split,
            split_queries=self.q[:size])

    def _forward(self, ctx: ForwardContext, size: int) -> torch.Tensor:
        with forward_context(ctx):
            return self.model(self.inputs.token_ids[:size], self.inputs.positions[:size])

    def _capture_size(self, size: int, pool) -> None:
        pieces, layers = [], []
        capturing = False

        def begin() -> None:
            nonlocal capturing
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)
            capturing = True

        def end() -> None:
            nonlocal capturing
            capturing = False  # first: a failing capture_end is not ended twice
            pieces[-1].capture_end()

        def split(layer: Attention, q: torch.Tensor) -> torch.Tensor:
            assert q.data_ptr() == self.q.data_ptr(), "the layer wrote its queries elsewhere"
            end()
            layers.append(layer)
            begin()
            return self.out[:size]

        ctx = self._context(size, split)  # its tensors made before capturing: no host copies
        begin()
        try:
            hidden = self._forward(ctx, size)
        finally:  # a failed capture must not leave the stream capturing
            if capturing:
                end()
        if len(layers) != len(self.model.attention_layers()):
            raise RuntimeError(f"{len(layers)} of {len(self.model.attention_layers())} attention "
                               "layers split the forward: the others attended inside a piece")
        self.graphs[size] = (pieces, layers, hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            self._forward(self._context(size, lambda layer, q: self.out[:size]), size)  # warm-up
            torch.cuda.synchronize()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._capture_size(size, pool)
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def fits(self, inputs: StepInputs) -> bool:
        return inputs.num_tokens <= self.sizes[-1]

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's logits (rank 0; None elsewhere)."""
        ctx = inputs.context
        n = inputs.token_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.inputs.load(inputs, size)
        pieces, layers, hidden = self.graphs[size]
        q, out = self.q[:n], self.out[:n]
        with forward_context(ctx):
            for piece, layer in zip(pieces, layers):
                piece.replay()
                layer.attend(q, out=out)
            pieces[-1].replay()
            return self.model.compute_logits(hidden[:n])
