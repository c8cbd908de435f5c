"""The data plane's copy of each live request, indexed by the slot the control plane assigned,
and the tensors of one step built from it.

Every request's tokens live in a [max_num_seqs, max_model_len] table on the model's device:
prompts are copied in once, sampled tokens are written there by the device itself, so a decode
step reads the token its predecessor sampled without a host round trip (the control plane may
send step N+1 before step N's tokens are back). Block tables live on the host (for the slot
mapping) and are mirrored on the device (for the attention kernels); a step carries only their
appended blocks. Counts (tokens, blocks) stay on the host: they are known when a step is built.
Per step, the host computes positions, token indices and slot mappings with a few vectorized
ops and moves them in one copy from a pinned staging buffer; no Python loop runs over tokens.
"""

from dataclasses import dataclass

import torch

from common.wire import unpack_i32
from dataplane.forward_context import ForwardContext
from dataplane.sampler import SamplingBatch, Uses
from protos import link_pb2


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    vocab_size: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass
class StepInputs:
    token_ids: torch.Tensor  # [num_tokens] int64, device
    positions: torch.Tensor  # [num_tokens] int64, device
    context: ForwardContext
    sampled_slots: torch.Tensor  # [num_sampled] int64, host: slots that produce a token
    # [num_sampled] int64, device: where each sampled token goes in the token table
    sampled_index: torch.Tensor


class _SlotParams:
    """Sampling parameters per slot, on the host, so a step gathers its rows at once."""

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


class _Staging:
    """Two pinned host buffers used in turn for the per-step host-to-device copy; a buffer is
    reused only after the copy that read it has run (its event)."""

    def __init__(self, size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.buffers = [torch.empty(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.turn = 0

    def to_device(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy int64 host tensors to the device in one transfer; returns device views."""
        i, self.turn = self.turn, 1 - self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()
        sizes = [p.numel() for p in parts]
        host = self.buffers[i][:sum(sizes)]
        torch.cat(parts, out=host)
        if self.device.type == "cpu":
            return list(host.clone().split(sizes))
        device = host.to(self.device, non_blocking=True)
        self.events[i].record()
        return list(device.split(sizes))


class InputBatch:
    def __init__(self, limits: BatchLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        s, max_blocks = limits.max_num_seqs, limits.max_blocks_per_seq
        self.token_ids = torch.zeros(s, limits.max_model_len, dtype=torch.int32, device=device)
        self.num_tokens = torch.zeros(s, dtype=torch.int64)
        self.num_prompt_tokens = torch.zeros(s, dtype=torch.int64)
        self.block_table = torch.zeros(s, max_blocks, dtype=torch.int32)
        self.block_table_device = torch.zeros(s, max_blocks, dtype=torch.int32, device=device)
        self.num_blocks = torch.zeros(s, dtype=torch.int64)
        self.params = _SlotParams(s)
        # positions, token indices, slot mapping (per token); query starts, lengths, slots
        # (per request); logits rows; block-table updates (three per new block)
        tokens, reqs = limits.max_num_batched_tokens, limits.max_num_seqs
        self._staging = _Staging(3 * tokens + 5 * reqs + 2 + 3 * s * max_blocks, device)

    # -- deltas --------------------------------------------------------------------------------

    def apply(self, step: link_pb2.Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Update slot state from the step's deltas; returns (slots, num_computed, num_scheduled)
        as host tensors."""
        for slot in unpack_i32(step.freed_slots):
            self.num_tokens[slot] = 0
            self.num_blocks[slot] = 0
        for new in step.new_requests:
            self._add(new)
        slots = _i32_tensor(step.slots).long()
        num_new_blocks = _i32_tensor(step.num_new_blocks).long()
        self._pending_blocks = None
        if len(step.new_block_ids):
            self._append_blocks(slots, num_new_blocks, _i32_tensor(step.new_block_ids))
        return (slots, _i32_tensor(step.num_computed_tokens).long(),
                _i32_tensor(step.num_scheduled_tokens).long())

    def _add(self, new: link_pb2.NewRequest) -> None:
        tokens = _i32_tensor(new.token_ids)
        assert len(tokens) <= self.limits.max_model_len, "request longer than max_model_len"
        self.token_ids[new.slot, :len(tokens)] = tokens.to(self.device)
        self.num_tokens[new.slot] = len(tokens)
        self.num_prompt_tokens[new.slot] = new.num_prompt_tokens
        self.num_blocks[new.slot] = 0
        self.params.set(new.slot, new.sampling)

    def _append_blocks(self, slots: torch.Tensor, counts: torch.Tensor, block_ids: torch.Tensor) -> None:
        owner = slots.repeat_interleave(counts)  # [num_new_blocks]: slot of each new block
        first = torch.cumsum(counts, 0) - counts
        column = self.num_blocks[owner] + torch.arange(len(block_ids)) - first.repeat_interleave(counts)
        self.block_table[owner, column] = block_ids
        self.num_blocks.index_add_(0, slots, counts)
        self._pending_blocks = (owner, column, block_ids.long())  # mirrored in prepare()

    # -- one step ------------------------------------------------------------------------------

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
        slot_mapping = (self.block_table[token_slot, positions // block_size].long() * block_size
                        + positions % block_size)
        is_sampled = seq_lens == self.num_tokens[slots]
        logits_indices = query_start_loc[1:][is_sampled] - 1
        sampled_index = (slots * max_len + seq_lens)[is_sampled]
        parts = [positions, token_slot * max_len + positions, slot_mapping, query_start_loc,
                 seq_lens, slots, logits_indices, sampled_index]
        if self._pending_blocks is not None:
            parts.extend(self._pending_blocks)
        device_parts = self._staging.to_device(parts)
        positions_d, token_index_d, slot_mapping_d, qsl_d, seq_lens_d, slots_d, logits_d, \
            sampled_index_d = device_parts[:8]
        if self._pending_blocks is not None:
            owner_d, column_d, ids_d = device_parts[8:]
            self.block_table_device[owner_d, column_d] = ids_d.int()
            self._pending_blocks = None
        max_blocks = int((-(-seq_lens // block_size)).max())
        seq_lens_host = seq_lens.tolist()
        context = ForwardContext(
            query_start_loc=qsl_d.int(), seq_lens=seq_lens_d.int(), slot_mapping=slot_mapping_d,
            block_tables=self.block_table_device[slots_d, :max_blocks],
            logits_indices=logits_d, max_query_len=int(num_scheduled.max()),
            max_seq_len=max(seq_lens_host), query_start_loc_host=query_start_loc.tolist(),
            seq_lens_host=seq_lens_host)
        token_ids = self.token_ids.view(-1)[token_index_d].long()
        return StepInputs(token_ids, positions_d, context, slots[is_sampled], sampled_index_d)

    def append_sampled(self, inputs: StepInputs, token_ids: torch.Tensor) -> None:
        """Record tokens sampled on the device (their values stay there)."""
        self.token_ids.view(-1)[inputs.sampled_index] = token_ids.to(torch.int32)
        self.num_tokens[inputs.sampled_slots] += 1

    def sampling_batch(self, slots: torch.Tensor) -> SamplingBatch:
        p = self.params
        num_output = self.num_tokens[slots] - self.num_prompt_tokens[slots]
        rows = slots.tolist()
        dev = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        temperature, top_k, top_p, min_p = (p.temperature[slots], p.top_k[slots], p.top_p[slots],
                                            p.min_p[slots])
        batch = SamplingBatch(
            temperature=dev(temperature), top_k=dev(top_k), top_p=dev(top_p), min_p=dev(min_p),
            presence_penalty=dev(p.presence_penalty[slots]),
            frequency_penalty=dev(p.frequency_penalty[slots]),
            repetition_penalty=dev(p.repetition_penalty[slots]),
            seeds=[p.seeds[s] for s in rows], output_index=num_output.tolist(),
            output_counts=None, prompt_mask=None, suppress_mask=None,
            max_logprobs=int(p.num_logprobs[slots].max()) if rows else -1,
            uses=Uses.of(temperature, top_k, top_p, min_p))
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
        """Output-token counts and prompt-token presence, [rows, vocab] each, on the device."""
        vocab = self.limits.vocab_size
        width = int(self.num_tokens[slots].max())
        slots_d = slots.to(self.device)
        tokens = self.token_ids[slots_d, :width].long()  # [rows, width]
        positions = torch.arange(width, device=self.device)
        num_prompt = self.num_prompt_tokens[slots].to(self.device).unsqueeze(1)
        num_tokens = self.num_tokens[slots].to(self.device).unsqueeze(1)
        is_prompt = positions < num_prompt
        is_output = ~is_prompt & (positions < num_tokens)
        zeros = torch.zeros(len(slots), vocab, device=self.device)
        counts = zeros.scatter_add(1, tokens, is_output.float())
        prompt = zeros.scatter_add(1, tokens, is_prompt.float()) > 0
        return counts, prompt
