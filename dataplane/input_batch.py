"""The data plane's copy of each live request, indexed by the slot the control plane assigned,
and the tensors of one step built from it.

Every request's tokens and block table sit in preallocated [max_num_seqs, ...] tables, so a step
only carries deltas (new requests, new blocks) and the model inputs are built with a handful of
vectorized gathers, never a Python loop over tokens.
"""

from dataclasses import dataclass

import torch

from common.wire import unpack_i32
from dataplane.forward_context import ForwardContext
from dataplane.sampler import SamplingBatch
from protos import link_pb2


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_model_len: int
    block_size: int
    vocab_size: int


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    context: ForwardContext
    sampled_slots: torch.Tensor  # [num_sampled] int64: slots that produce a token, batch order


class _SlotParams:
    """Sampling parameters per slot, as tensors so a step gathers its rows at once."""

    def __init__(self, max_num_seqs: int) -> None:
        zeros = lambda dtype: torch.zeros(max_num_seqs, dtype=dtype)  # noqa: E731
        self.temperature = zeros(torch.float32)
        self.top_k = zeros(torch.int64)
        self.top_p = zeros(torch.float32)
        self.min_p = zeros(torch.float32)
        self.presence_penalty = zeros(torch.float32)
        self.frequency_penalty = zeros(torch.float32)
        self.repetition_penalty = zeros(torch.float32)
        self.min_tokens = zeros(torch.int64)
        self.num_logprobs = zeros(torch.int64)  # -1: none
        self.seeds: list[int | None] = [None] * max_num_seqs
        self.suppressed: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * max_num_seqs

    def set(self, slot: int, options: link_pb2.SamplingOptions) -> None:
        self.temperature[slot] = options.temperature
        self.top_k[slot] = options.top_k
        self.top_p[slot] = options.top_p
        self.min_p[slot] = options.min_p
        self.presence_penalty[slot] = options.presence_penalty
        self.frequency_penalty[slot] = options.frequency_penalty
        self.repetition_penalty[slot] = options.repetition_penalty
        self.min_tokens[slot] = options.min_tokens
        self.num_logprobs[slot] = options.logprobs if options.HasField("logprobs") else -1
        self.seeds[slot] = options.seed if options.HasField("seed") else None
        self.suppressed[slot] = _i32_tensor(options.suppressed_token_ids).long()


def _i32_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(unpack_i32(data), dtype=torch.int32)


class InputBatch:
    def __init__(self, limits: BatchLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        max_blocks = -(-limits.max_model_len // limits.block_size)
        self.token_ids = torch.zeros(limits.max_num_seqs, limits.max_model_len, dtype=torch.int32)
        self.num_tokens = torch.zeros(limits.max_num_seqs, dtype=torch.int64)
        self.num_prompt_tokens = torch.zeros(limits.max_num_seqs, dtype=torch.int64)
        self.block_table = torch.zeros(limits.max_num_seqs, max_blocks, dtype=torch.int32)
        self.num_blocks = torch.zeros(limits.max_num_seqs, dtype=torch.int64)
        self.params = _SlotParams(limits.max_num_seqs)

    def apply(self, step: link_pb2.Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Update slot state from the step's deltas; returns (slots, num_computed, num_scheduled)."""
        for slot in unpack_i32(step.freed_slots):
            self.num_tokens[slot] = 0
            self.num_blocks[slot] = 0
        for new in step.new_requests:
            self._add(new)
        slots = _i32_tensor(step.slots).long()
        num_new_blocks = _i32_tensor(step.num_new_blocks).long()
        if len(step.new_block_ids):
            self._append_blocks(slots, num_new_blocks, _i32_tensor(step.new_block_ids))
        return (slots, _i32_tensor(step.num_computed_tokens).long(),
                _i32_tensor(step.num_scheduled_tokens).long())

    def _add(self, new: link_pb2.NewRequest) -> None:
        tokens = _i32_tensor(new.token_ids)
        assert len(tokens) <= self.limits.max_model_len, "request longer than max_model_len"
        self.token_ids[new.slot, :len(tokens)] = tokens
        self.num_tokens[new.slot] = len(tokens)
        self.num_prompt_tokens[new.slot] = new.num_prompt_tokens
        self.num_blocks[new.slot] = 0
        self.params.set(new.slot, new.sampling)

    def _append_blocks(self, slots: torch.Tensor, counts: torch.Tensor, block_ids: torch.Tensor) -> None:
        owner = slots.repeat_interleave(counts)  # [num_new_blocks]: slot of each new block
        first = torch.cumsum(counts, 0) - counts
        rank_in_req = torch.arange(len(block_ids)) - first.repeat_interleave(counts)
        self.block_table[owner, self.num_blocks[owner] + rank_in_req] = block_ids
        self.num_blocks.index_add_(0, slots, counts)

    def prepare(self, slots: torch.Tensor, num_computed: torch.Tensor,
                num_scheduled: torch.Tensor) -> StepInputs:
        block_size, max_len = self.limits.block_size, self.limits.max_model_len
        seq_lens = num_computed + num_scheduled
        assert bool((seq_lens <= self.num_tokens[slots]).all()), "scheduled past the known tokens"
        assert bool((seq_lens <= self.num_blocks[slots] * block_size).all()), "tokens without blocks"
        query_start_loc = torch.zeros(len(slots) + 1, dtype=torch.int64)
        torch.cumsum(num_scheduled, 0, out=query_start_loc[1:])
        token_slot = slots.repeat_interleave(num_scheduled)  # [num_tokens]
        positions = (torch.arange(int(query_start_loc[-1]))
                     - (query_start_loc[:-1] - num_computed).repeat_interleave(num_scheduled))
        token_ids = self.token_ids.view(-1)[token_slot * max_len + positions].long()
        blocks = self.block_table[token_slot, positions // block_size].long()
        slot_mapping = blocks * block_size + positions % block_size
        is_sampled = seq_lens == self.num_tokens[slots]
        max_blocks = int((-(-seq_lens // block_size)).max())
        seq_lens_host = seq_lens.tolist()
        dev = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        context = ForwardContext(
            query_start_loc=dev(query_start_loc.int()),
            seq_lens=dev(seq_lens.int()),
            slot_mapping=dev(slot_mapping),
            block_tables=dev(self.block_table[slots, :max_blocks]),
            logits_indices=dev(query_start_loc[1:][is_sampled] - 1),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max(seq_lens_host),
            query_start_loc_host=query_start_loc.tolist(),
            seq_lens_host=seq_lens_host,
        )
        return StepInputs(dev(token_ids), dev(positions), context, slots[is_sampled])

    def append_sampled(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.token_ids[slots, self.num_tokens[slots]] = token_ids.to(torch.int32)
        self.num_tokens[slots] += 1

    def sampling_batch(self, slots: torch.Tensor) -> SamplingBatch:
        p = self.params
        num_output = self.num_tokens[slots] - self.num_prompt_tokens[slots]
        rows = slots.tolist()
        dev = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        batch = SamplingBatch(
            temperature=dev(p.temperature[slots]), top_k=dev(p.top_k[slots]),
            top_p=dev(p.top_p[slots]), min_p=dev(p.min_p[slots]),
            presence_penalty=dev(p.presence_penalty[slots]),
            frequency_penalty=dev(p.frequency_penalty[slots]),
            repetition_penalty=dev(p.repetition_penalty[slots]),
            seeds=[p.seeds[s] for s in rows], output_index=num_output.tolist(),
            output_counts=None, prompt_mask=None, suppress_mask=None,
            max_logprobs=int(p.num_logprobs[slots].max()) if rows else -1)
        if bool(((p.repetition_penalty[slots] != 1) | (p.presence_penalty[slots] != 0)
                 | (p.frequency_penalty[slots] != 0)).any()):
            batch.output_counts, batch.prompt_mask = self._token_counts(slots)
        needs_suppress = (num_output < p.min_tokens[slots]).tolist()
        if any(needs_suppress):
            mask = torch.zeros(len(rows), self.limits.vocab_size, dtype=torch.bool)
            for row, slot in enumerate(rows):
                if needs_suppress[row]:
                    mask[row, p.suppressed[slot]] = True
            batch.suppress_mask = dev(mask)
        return batch

    def _token_counts(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-token counts and prompt-token presence, [rows, vocab] each."""
        vocab = self.limits.vocab_size
        width = int(self.num_tokens[slots].max())
        tokens = self.token_ids[slots, :width].long()  # [rows, width]
        positions = torch.arange(width)
        is_prompt = positions < self.num_prompt_tokens[slots].unsqueeze(1)
        is_output = ~is_prompt & (positions < self.num_tokens[slots].unsqueeze(1))
        counts = torch.zeros(len(slots), vocab).scatter_add_(1, tokens, is_output.float())
        prompt = torch.zeros(len(slots), vocab).scatter_add_(1, tokens, is_prompt.float()) > 0
        return counts.to(self.device), prompt.to(self.device)
