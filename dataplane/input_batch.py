"""The data plane's copy of each live request, indexed by the slot the control plane assigned,
and the tensors of one step built from it.

Every request's tokens live in a [max_num_seqs, max_model_len] table on the model's device:
prompts are copied in once, sampled tokens are written there by the device itself, so a decode
step reads the token its predecessor sampled without a host round trip (the control plane may
send step N+1 before step N's tokens are back). Block tables live on the host (for the slot
mapping) and are mirrored on the device (for the attention kernels); a step carries only their
appended blocks. Counts (tokens, blocks) stay on the host: they are known when a step is built.
Per step, the host computes positions, token indices and slot mappings with a few vectorized
numpy ops (a fraction of a torch CPU op's fixed cost each) straight into a pinned staging buffer
and moves them in one copy; no Python loop runs over tokens. Sampling parameters live in a
per-slot table mirrored on the device: a step gathers its rows there, and the host decides from
its copy which sampling features run, so nothing waits for the device.
"""

from dataclasses import dataclass

import numpy as np
import torch

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
    sampled_slots: np.ndarray  # [num_sampled] int64, host: slots that produce a token
    sampled_slots_device: torch.Tensor  # the same, on the device
    # [num_sampled] int64, device: where each sampled token goes in the token table
    sampled_index: torch.Tensor


def _i32(data: bytes) -> np.ndarray:
    """A packed int32 array (common.wire) as a read-only numpy view of the message's bytes."""
    return np.frombuffer(data, dtype=np.int32)


class _SlotParams:
    """Sampling parameters per slot: a host table (what the host decides on) and its mirror on
    the device (what a step gathers its rows from), refreshed in a step that follows changes."""

    # columns of the float table; top_k is exact in float32 (clamped below 2**24)
    COLUMNS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "top_k")
    TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION, TOP_K = range(7)

    def __init__(self, max_num_seqs: int) -> None:
        self.table = np.zeros((max_num_seqs, len(self.COLUMNS)), dtype=np.float32)
        self.device_table: torch.Tensor | None = None  # set by the first refresh
        self.dirty = True
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_logprobs = np.zeros(max_num_seqs, dtype=np.int64)  # -1: none
        self.has_seed = np.zeros(max_num_seqs, dtype=bool)
        self.seeds: list[int | None] = [None] * max_num_seqs
        self.suppressed: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * max_num_seqs

    def set(self, slot: int, options: link_pb2.SamplingOptions) -> None:
        self.table[slot] = (options.temperature, options.top_p, options.min_p,
                            options.presence_penalty, options.frequency_penalty,
                            options.repetition_penalty, min(options.top_k, 1 << 24))
        self.dirty = True
        self.min_tokens[slot] = options.min_tokens
        self.num_logprobs[slot] = options.logprobs if options.HasField("logprobs") else -1
        self.has_seed[slot] = options.HasField("seed")
        self.seeds[slot] = options.seed if options.HasField("seed") else None
        self.suppressed[slot] = _i32(options.suppressed_token_ids).astype(np.int64)


class _Staging:
    """Two pinned host buffers used in turn for host-to-device copies; a buffer is reused only
    after the copy that read it has run (its event). They grow when a copy needs more."""

    def __init__(self, size: int, device: torch.device, dtype: torch.dtype = torch.int64) -> None:
        self.device = device
        self.dtype = dtype
        self.events = [torch.cuda.Event() if device.type == "cuda" else None for _ in range(2)]
        self.turn = 0
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        for event in self.events:
            if event is not None:
                event.synchronize()
        pin = self.device.type == "cuda"
        self.buffers = [torch.empty(size, dtype=self.dtype, pin_memory=pin) for _ in range(2)]
        self.arrays = [b.numpy() for b in self.buffers]  # the same memory, for numpy writes

    def to_device(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy host arrays to the device in one transfer; returns device views."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if total > self.buffers[0].numel():
            self._allocate(max(total, 2 * self.buffers[0].numel()))
        i, self.turn = self.turn, 1 - self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()
        if parts:
            np.concatenate(parts, out=self.arrays[i][:total], casting="unsafe")
        host = self.buffers[i][:total]
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
        self.num_tokens = np.zeros(s, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(s, dtype=np.int64)
        self.block_table = np.zeros((s, max_blocks), dtype=np.int32)
        self.block_table_device = torch.zeros(s, max_blocks, dtype=torch.int32, device=device)
        self.num_blocks = np.zeros(s, dtype=np.int64)
        self.params = _SlotParams(s)
        # positions, token indices, slot mapping (per token); query starts, lengths, slots
        # (per request); logits rows, sampled slots; block-table updates (three per new block)
        tokens, reqs = limits.max_num_batched_tokens, limits.max_num_seqs
        self._staging = _Staging(3 * tokens + 6 * reqs + 2 + 3 * s * max_blocks, device)
        self._param_staging = _Staging(self.params.table.size, device, torch.float32)
        self._prompt_staging = _Staging(2 * (tokens + limits.max_model_len), device, torch.int32)
        self._pending_blocks: tuple[np.ndarray, ...] | None = None

    # -- deltas --------------------------------------------------------------------------------

    def apply(self, step: link_pb2.Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Update slot state from the step's deltas; returns (slots, num_computed,
        num_scheduled) as host arrays."""
        freed = _i32(step.freed_slots)
        self.num_tokens[freed] = 0
        self.num_blocks[freed] = 0
        if step.new_requests:
            self._add(step.new_requests)
        slots = _i32(step.slots).astype(np.int64)
        self._pending_blocks = None
        if len(step.new_block_ids):
            self._append_blocks(slots, _i32(step.num_new_blocks).astype(np.int64),
                                _i32(step.new_block_ids))
        return (slots, _i32(step.num_computed_tokens).astype(np.int64),
                _i32(step.num_scheduled_tokens).astype(np.int64))

    def _add(self, new_requests) -> None:
        """Copy the new requests' tokens into the token table (one transfer, no wait for the
        device) and record their counts and sampling parameters."""
        max_len = self.limits.max_model_len
        tokens = [_i32(new.token_ids) for new in new_requests]
        for new, t in zip(new_requests, tokens):
            assert len(t) <= max_len, "request longer than max_model_len"
            self.num_tokens[new.slot] = len(t)
            self.num_prompt_tokens[new.slot] = new.num_prompt_tokens
            self.num_blocks[new.slot] = 0
            self.params.set(new.slot, new.sampling)
        index = np.concatenate([new.slot * max_len + np.arange(len(t))
                                for new, t in zip(new_requests, tokens)])
        values, index_d = self._prompt_staging.to_device([np.concatenate(tokens), index])
        self.token_ids.view(-1)[index_d.long()] = values

    def _append_blocks(self, slots: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        owner = np.repeat(slots, counts)  # [num_new_blocks]: slot of each new block
        first = np.cumsum(counts) - counts
        column = self.num_blocks[owner] + np.arange(len(block_ids)) - np.repeat(first, counts)
        self.block_table[owner, column] = block_ids
        np.add.at(self.num_blocks, slots, counts)
        self._pending_blocks = (owner, column, block_ids)  # mirrored in prepare()

    # -- one step ------------------------------------------------------------------------------

    def prepare(self, slots: np.ndarray, num_computed: np.ndarray,
                num_scheduled: np.ndarray) -> StepInputs:
        block_size, max_len = self.limits.block_size, self.limits.max_model_len
        seq_lens = num_computed + num_scheduled
        assert (seq_lens <= self.num_tokens[slots]).all(), "scheduled past the known tokens"
        assert (seq_lens <= self.num_blocks[slots] * block_size).all(), "tokens without blocks"
        query_start_loc = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        token_slot = np.repeat(slots, num_scheduled)  # [num_tokens]
        positions = (np.arange(query_start_loc[-1])
                     - np.repeat(query_start_loc[:-1] - num_computed, num_scheduled))
        slot_mapping = (self.block_table[token_slot, positions // block_size].astype(np.int64)
                        * block_size + positions % block_size)
        is_sampled = seq_lens == self.num_tokens[slots]
        logits_indices = query_start_loc[1:][is_sampled] - 1
        sampled_slots = slots[is_sampled]
        sampled_index = sampled_slots * max_len + seq_lens[is_sampled]
        parts = [positions, token_slot * max_len + positions, slot_mapping, query_start_loc,
                 seq_lens, slots, logits_indices, sampled_index, sampled_slots]
        if self._pending_blocks is not None:
            parts.extend(self._pending_blocks)
        device_parts = self._staging.to_device(parts)
        positions_d, token_index_d, slot_mapping_d, qsl_d, seq_lens_d, slots_d, logits_d, \
            sampled_index_d, sampled_slots_d = device_parts[:9]
        if self._pending_blocks is not None:
            owner_d, column_d, ids_d = device_parts[9:]
            self.block_table_device[owner_d, column_d] = ids_d.int()
            self._pending_blocks = None
        max_blocks = int(-(-seq_lens.max() // block_size))
        seq_lens_host = seq_lens.tolist()
        context = ForwardContext(
            query_start_loc=qsl_d.int(), seq_lens=seq_lens_d.int(), slot_mapping=slot_mapping_d,
            block_tables=self.block_table_device[slots_d, :max_blocks],
            logits_indices=logits_d, max_query_len=int(num_scheduled.max()),
            max_seq_len=max(seq_lens_host), query_start_loc_host=query_start_loc.tolist(),
            seq_lens_host=seq_lens_host)
        token_ids = self.token_ids.view(-1)[token_index_d].long()
        return StepInputs(token_ids, positions_d, context, sampled_slots, sampled_slots_d,
                          sampled_index_d)

    def append_sampled(self, inputs: StepInputs, token_ids: torch.Tensor) -> None:
        """Record tokens sampled on the device (their values stay there)."""
        self.token_ids.view(-1)[inputs.sampled_index] = token_ids.to(torch.int32)
        self.num_tokens[inputs.sampled_slots] += 1

    def sampling_batch(self, inputs: StepInputs) -> SamplingBatch:
        p, c = self.params, _SlotParams
        slots = inputs.sampled_slots
        if p.dirty or p.device_table is None:
            [table] = self._param_staging.to_device([p.table.reshape(-1)])
            p.device_table, p.dirty = table.view(p.table.shape), False
        rows = p.device_table[inputs.sampled_slots_device]  # [rows, columns], device
        host = p.table[slots]  # the same, host
        num_output = self.num_tokens[slots] - self.num_prompt_tokens[slots]
        seeded = bool(p.has_seed[slots].any())
        penalized = bool(((host[:, c.REPETITION] != 1) | (host[:, c.PRESENCE] != 0)
                          | (host[:, c.FREQUENCY] != 0)).any())
        batch = SamplingBatch(
            temperature=rows[:, c.TEMPERATURE], top_k=rows[:, c.TOP_K].long(),
            top_p=rows[:, c.TOP_P], min_p=rows[:, c.MIN_P],
            presence_penalty=rows[:, c.PRESENCE], frequency_penalty=rows[:, c.FREQUENCY],
            repetition_penalty=rows[:, c.REPETITION],
            seeds=[p.seeds[s] for s in slots.tolist()] if seeded else [],
            output_index=num_output.tolist() if seeded else [],
            output_counts=None, prompt_mask=None, suppress_mask=None,
            max_logprobs=int(p.num_logprobs[slots].max()) if len(slots) else -1,
            uses=Uses(all_greedy=bool((host[:, c.TEMPERATURE] == 0).all()),
                      top_k=bool((host[:, c.TOP_K] > 0).any()),
                      top_p=bool((host[:, c.TOP_P] < 1).any()),
                      min_p=bool((host[:, c.MIN_P] > 0).any())))
        if penalized:
            batch.output_counts, batch.prompt_mask = self._token_counts(inputs)
        needs_suppress = num_output < p.min_tokens[slots]
        if needs_suppress.any():
            mask = torch.zeros(len(slots), self.limits.vocab_size, dtype=torch.bool)
            for row in np.flatnonzero(needs_suppress).tolist():
                mask[row, torch.from_numpy(p.suppressed[slots[row]])] = True
            batch.suppress_mask = mask.to(self.device, non_blocking=True)
        return batch

    def _token_counts(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Output-token counts and prompt-token presence, [rows, vocab] each, on the device."""
        slots, vocab = inputs.sampled_slots, self.limits.vocab_size
        width = int(self.num_tokens[slots].max())
        tokens = self.token_ids[inputs.sampled_slots_device, :width].long()  # [rows, width]
        positions = torch.arange(width, device=self.device)
        to_device = lambda a: torch.from_numpy(a).to(self.device, non_blocking=True)  # noqa: E731
        num_prompt = to_device(self.num_prompt_tokens[slots]).unsqueeze(1)
        num_tokens = to_device(self.num_tokens[slots]).unsqueeze(1)
        is_prompt = positions < num_prompt
        is_output = ~is_prompt & (positions < num_tokens)
        zeros = torch.zeros(len(slots), vocab, device=self.device)
        counts = zeros.scatter_add(1, tokens, is_output.float())
        prompt = zeros.scatter_add(1, tokens, is_prompt.float()) > 0
        return counts, prompt
