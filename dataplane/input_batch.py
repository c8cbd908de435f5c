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
and moves them in one copy (`stage`); no Python loop runs over tokens. A decode step that
replays a CUDA graph goes from there with one kernel (kernels/decode_inputs.py); other steps
build their tensors with torch ops (`prepare`). Sampling parameters live in a per-slot table
mirrored on the device: a step gathers its rows there, and the host decides from its copy which
sampling features run, so nothing waits for the device.
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
class StagedStep:
    """A step's per-token and per-request arrays on the device: int64 views of one copy from
    the host (no kernel made them)."""

    positions: torch.Tensor  # [num_tokens]
    token_index: torch.Tensor  # [num_tokens]: index into the flattened token table
    slot_mapping: torch.Tensor  # [num_tokens]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]
    slots: torch.Tensor  # [num_reqs]
    logits_indices: torch.Tensor  # [num_sampled]
    sampled_index: torch.Tensor  # [num_sampled]: where each sampled token goes in the table
    sampled_slots: torch.Tensor  # [num_sampled]
    # The blocks this step appends, per request: the first one's index into new_blocks, their
    # count and the column of the first; and per block: its slot, column and id.
    new_start: torch.Tensor  # [num_reqs]
    new_count: torch.Tensor  # [num_reqs]
    new_column: torch.Tensor  # [num_reqs]
    new_owner: torch.Tensor  # [num_new_blocks]
    new_columns: torch.Tensor  # [num_new_blocks]
    new_blocks: torch.Tensor  # [num_new_blocks]


@dataclass
class StepInputs:
    """One step's inputs. `staged` always; the eager tensors (token ids, positions, forward
    context) only when `InputBatch.prepare` built them: a replayed decode graph fills its own
    buffers from `staged` in one kernel instead."""

    staged: StagedStep
    num_reqs: int
    num_tokens: int
    max_query_len: int
    sampled_slots: np.ndarray  # [num_sampled] int64, host: slots that produce a token
    host_query_start_loc: np.ndarray  # [num_reqs + 1] int64, what staged holds
    host_seq_lens: np.ndarray  # [num_reqs] int64
    token_ids: torch.Tensor | None = None  # [num_tokens] int64, device
    positions: torch.Tensor | None = None  # [num_tokens] int64, device
    context: ForwardContext | None = None

    @property
    def sampled_slots_device(self) -> torch.Tensor:
        return self.staged.sampled_slots

    @property
    def sampled_index(self) -> torch.Tensor:
        return self.staged.sampled_index


def _i32(data: bytes) -> np.ndarray:
    """A packed int32 array (common.wire) as a read-only numpy view of the message's bytes."""
    return np.frombuffer(data, dtype=np.int32)


class _SlotParams:
    """Sampling parameters per slot: a host table (what the host decides on) and its mirror on
    the device (what a step gathers its rows from), refreshed by the step that brings new
    requests (InputBatch._refresh_params)."""

    # columns of the float table; top_k is exact in float32 (clamped below 2**24)
    COLUMNS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "top_k")
    TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION, TOP_K = range(7)

    def __init__(self, max_num_seqs: int) -> None:
        self.table = np.zeros((max_num_seqs, len(self.COLUMNS)), dtype=np.float32)
        self.device_table: torch.Tensor | None = None  # set by the first refresh
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_logprobs = np.zeros(max_num_seqs, dtype=np.int64)  # -1: none
        self.has_seed = np.zeros(max_num_seqs, dtype=bool)
        self.seeds: list[int | None] = [None] * max_num_seqs
        self.suppressed: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * max_num_seqs
        self.version = 0  # bumped by every set: a sampling batch built before it is stale

    def set(self, slot: int, options: link_pb2.SamplingOptions) -> None:
        self.table[slot] = (options.temperature, options.top_p, options.min_p,
                            options.presence_penalty, options.frequency_penalty,
                            options.repetition_penalty, min(options.top_k, 1 << 24))
        self.min_tokens[slot] = options.min_tokens
        self.num_logprobs[slot] = options.logprobs if options.HasField("logprobs") else -1
        self.has_seed[slot] = options.HasField("seed")
        self.seeds[slot] = options.seed if options.HasField("seed") else None
        self.suppressed[slot] = _i32(options.suppressed_token_ids).astype(np.int64)
        self.version += 1


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
    @staticmethod
    def device_bytes(limits: BatchLimits) -> int:
        """What the tables on the device take (the KV budget sets it aside): the token table
        (int64) and the block mirror (int32)."""
        return limits.max_num_seqs * (8 * limits.max_model_len + 4 * limits.max_blocks_per_seq)

    def __init__(self, limits: BatchLimits, device: torch.device) -> None:
        self.limits = limits
        self.device = device
        s, max_blocks = limits.max_num_seqs, limits.max_blocks_per_seq
        # int64, the dtype the embedding takes and the sampler returns: no casts per step
        self.token_ids = torch.zeros(s, limits.max_model_len, dtype=torch.int64, device=device)
        self.num_tokens = np.zeros(s, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(s, dtype=np.int64)
        self.block_table = np.zeros((s, max_blocks), dtype=np.int32)
        self.block_table_device = torch.zeros(s, max_blocks, dtype=torch.int32, device=device)
        self.num_blocks = np.zeros(s, dtype=np.int64)
        self.params = _SlotParams(s)
        # StagedStep's arrays: three per token, nine per request (query starts one more, logits
        # rows, sampled index and slots at most one each), three per new block
        tokens, reqs = limits.max_num_batched_tokens, limits.max_num_seqs
        self._staging = _Staging(3 * tokens + 9 * reqs + 1 + 3 * s * max_blocks, device)
        self._param_staging = _Staging(self.params.table.size, device, torch.float32)
        self._prompt_staging = _Staging(2 * (tokens + limits.max_model_len), device)
        self._new_blocks: list[np.ndarray] | None = None  # StagedStep's new_*, set by apply()
        # The last sampling batch that the next step may reuse: (its slots, the parameters'
        # version, the batch); see sampling_batch
        self._reusable: tuple[bytes, int, SamplingBatch] | None = None

    # -- deltas --------------------------------------------------------------------------------

    def apply(self, step: link_pb2.Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Update slot state from the step's deltas; returns (slots, num_computed,
        num_scheduled) as host arrays."""
        freed = _i32(step.freed_slots)
        self.num_tokens[freed] = 0
        self.num_blocks[freed] = 0
        if step.new_requests:
            self._add(step.new_requests)
            self._refresh_params()
        slots = _i32(step.slots).astype(np.int64)
        counts = (_i32(step.num_new_blocks).astype(np.int64) if len(step.new_block_ids)
                  else np.zeros(len(slots), dtype=np.int64))
        self._append_blocks(slots, counts, _i32(step.new_block_ids))
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
        self.token_ids.view(-1)[index_d] = values

    def _refresh_params(self) -> None:
        """Mirror the sampling parameters on the device, at the start of the step that changed
        them: its copy then runs before the step's forward, so the buffer it reuses (the copy
        two refreshes back) is long done. Issued after the forward, at sampling, it waited for
        that copy behind whole steps: 5.7 ms of host time a 16k-token prompt step on the H200
        (bench/host_profile.py --timers, 6f1e38d)."""
        p = self.params
        [table] = self._param_staging.to_device([p.table.T.reshape(-1)])
        # column-major: a gathered column is contiguous
        p.device_table = table.view(p.table.shape[::-1])

    def _append_blocks(self, slots: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        owner = np.repeat(slots, counts)  # [num_new_blocks]: slot of each new block
        first = np.cumsum(counts) - counts
        if len(block_ids):  # each request's blocks take its row's next columns
            assert len(np.unique(slots)) == len(slots), "a slot scheduled twice in one step"
        first_column = self.num_blocks[slots]
        column = np.repeat(first_column - first, counts) + np.arange(len(block_ids))
        self.block_table[owner, column] = block_ids
        self.num_blocks[slots] += counts
        self._new_blocks = [first, counts, first_column, owner, column, block_ids]

    # -- one step ------------------------------------------------------------------------------

    def stage(self, slots: np.ndarray, num_computed: np.ndarray,
              num_scheduled: np.ndarray) -> StepInputs:
        """The step's arrays computed on the host and moved to the device in one copy; nothing
        else runs on the device (a decode graph's `decode_inputs` kernel takes it from here)."""
        block_size, max_len = self.limits.block_size, self.limits.max_model_len
        seq_lens = num_computed + num_scheduled
        assert (seq_lens <= self.num_tokens[slots]).all(), "scheduled past the known tokens"
        assert (seq_lens <= self.num_blocks[slots] * block_size).all(), "tokens without blocks"
        assert self._new_blocks is not None, "apply() the step first"
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
                 seq_lens, slots, logits_indices, sampled_index, sampled_slots, *self._new_blocks]
        self._new_blocks = None
        staged = StagedStep(*self._staging.to_device(parts))
        return StepInputs(staged, num_reqs=len(slots), num_tokens=int(query_start_loc[-1]),
                          max_query_len=int(num_scheduled.max()), sampled_slots=sampled_slots,
                          host_query_start_loc=query_start_loc, host_seq_lens=seq_lens)

    def prepare(self, inputs: StepInputs) -> StepInputs:
        """A staged step's eager tensors: its token ids, the forward context, and the device's
        block mirror updated with the step's new blocks first."""
        staged = inputs.staged
        if staged.new_blocks.numel():
            self.block_table_device[staged.new_owner, staged.new_columns] = \
                staged.new_blocks.int()
        max_blocks = int(-(-inputs.host_seq_lens.max() // self.limits.block_size))
        seq_lens_host = inputs.host_seq_lens.tolist()
        inputs.context = ForwardContext(
            query_start_loc=staged.query_start_loc.int(), seq_lens=staged.seq_lens.int(),
            slot_mapping=staged.slot_mapping,
            block_tables=self.block_table_device[staged.slots, :max_blocks],
            logits_indices=staged.logits_indices, max_query_len=inputs.max_query_len,
            max_seq_len=max(seq_lens_host),
            query_start_loc_host=inputs.host_query_start_loc.tolist(),
            seq_lens_host=seq_lens_host)
        inputs.token_ids = self.token_ids.view(-1)[staged.token_index]
        inputs.positions = staged.positions
        return inputs

    def append_sampled(self, inputs: StepInputs, token_ids: torch.Tensor) -> None:
        """Record tokens sampled on the device (their values stay there)."""
        self.token_ids.view(-1)[inputs.sampled_index] = token_ids
        self.num_tokens[inputs.sampled_slots] += 1

    def sampling_batch(self, inputs: StepInputs) -> SamplingBatch:
        """The step's sampling parameters, gathered on the device, and the host's decisions on
        them. A batch without seeds, penalties or min_tokens still to enforce depends only on
        its slots and their parameters: the next step that samples the same slots, with no
        parameter set in between, reuses it (a decode batch's usual case; building it took
        0.09-0.17 ms of rank 0's host time a decode step on the H200: bench/README.md)."""
        key = inputs.sampled_slots.tobytes()
        if self._reusable is not None and self._reusable[:2] == (key, self.params.version):
            return self._reusable[2]
        batch = self._new_sampling_batch(inputs)
        is_reusable = not (batch.seeds or batch.output_counts is not None
                           or batch.suppress_mask is not None)
        self._reusable = (key, self.params.version, batch) if is_reusable else None
        return batch

    def _new_sampling_batch(self, inputs: StepInputs) -> SamplingBatch:
        p, c = self.params, _SlotParams
        slots = inputs.sampled_slots
        assert p.device_table is not None, "a slot samples before any request was added"
        columns = p.device_table[:, inputs.sampled_slots_device]  # [columns, rows], device
        host = p.table[slots]  # the same, host
        num_output = self.num_tokens[slots] - self.num_prompt_tokens[slots]
        seeded = bool(p.has_seed[slots].any())
        penalized = bool(((host[:, c.REPETITION] != 1) | (host[:, c.PRESENCE] != 0)
                          | (host[:, c.FREQUENCY] != 0)).any())
        batch = SamplingBatch(
            temperature=columns[c.TEMPERATURE], top_k=columns[c.TOP_K],
            top_p=columns[c.TOP_P], min_p=columns[c.MIN_P],
            presence_penalty=columns[c.PRESENCE], frequency_penalty=columns[c.FREQUENCY],
            repetition_penalty=columns[c.REPETITION],
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
        tokens = self.token_ids[inputs.sampled_slots_device, :width]  # [rows, width]
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
