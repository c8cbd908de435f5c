"""Runs steps: applies a Step's deltas to the slot state, runs the model, samples on rank 0.

`submit` launches a step's device work and returns at once; `finish` waits for its tokens. Rank 0
submits step N+1 before finishing step N whenever the control plane has sent it, so the device
always has the next step queued while the host packs and sends the previous result.
"""

import gc
import logging
import pathlib
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from common.wire import pack_f32, pack_i32
from dataplane import kv_cache
from dataplane.attention import AttentionBackend, kv_block_size, make_backend
from dataplane.attention.flash_attn_backend import Fa4Error
from dataplane.cuda_graphs import MAX_MIXED_TOKENS, DecodeGraphs, MixedGraphs
from dataplane.distributed import broadcast_from_rank0, tp_rank, tp_size
from dataplane.forward_context import forward_context
from dataplane.input_batch import BatchLimits, InputBatch, StepInputs
from dataplane.loader import load_config, load_model, resolve_dtype
from dataplane.sampler import SamplerOutput, SamplingBatch, sample
from dataplane.warmup import DummySteps
from protos import link_pb2

log = logging.getLogger("splitserve.dataplane")


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: pathlib.Path
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    block_size: int | None = None  # None: the attention backend's preferred (unless it needs one)
    num_kv_blocks: int | None = None  # a cap on the KV cache, for small-memory runs and tests
    cpu_kv_cache_gib: float = 1.0  # KV cache budget on CPU
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the data plane may hold
    enforce_eager: bool = False  # no CUDA graphs
    prompt_graphs: bool = True  # steps with prompt tokens as piecewise graphs (cuda_graphs.py)
    pdl: bool = True  # programmatic dependent launch of our kernels (Hopper+; kernels/pdl.py)
    load_format: str = "safetensors"  # or "dummy": random weights (benchmarks)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        if self.block_size is not None and (self.block_size < 1
                                            or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, not {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not "
                             f"{self.gpu_memory_utilization}")


@dataclass
class PendingStep:
    """A submitted step whose tokens are still on their way to the host."""

    step_id: int
    started: float
    submitted: float
    sampled_slots: np.ndarray  # host
    out: SamplerOutput | None  # rank 0
    host_tokens: torch.Tensor | None  # host copy being filled
    # logprobs asked per sampled row, read at submit: by finish() the next step may have given
    # a finished request's slot to another request
    num_logprobs: np.ndarray | None = None
    # rank 0 on CUDA: timing events at the start of this step's device work and at the end of
    # the step's before it (None for the first step of an epoch), for Timings.device_idle_ms,
    # and at this step's end, for Timings.device_ms
    device_start: torch.cuda.Event | None = None
    previous_end: torch.cuda.Event | None = None
    device_end: torch.cuda.Event | None = None

    @property
    def done(self) -> torch.cuda.Event | None:
        """What to wait for before reading host_tokens: the step's end, when there are tokens
        on their way from a CUDA device (the copy is the step's last work)."""
        return self.device_end if self.host_tokens is not None else None

    def is_done(self) -> bool:
        return self.done is None or self.done.query()

    def device_idle_ms(self) -> float:
        """The device's idle time between the previous step's work and this one's, once this
        step's work has started (0 when that is not known yet, or not on CUDA)."""
        if self.previous_end is None or not self.device_start.query():
            return 0.0
        return self.previous_end.elapsed_time(self.device_start)

    def device_ms(self) -> float:
        """The device's time on this step, once it has finished (0 before that, or not on
        CUDA)."""
        if self.device_end is None or not self.device_end.query():
            return 0.0
        return self.device_start.elapsed_time(self.device_end)


class ModelRunner:
    def __init__(self, config: RunnerConfig, hf_config: PretrainedConfig, model: torch.nn.Module,
                 dtype: torch.dtype, device: torch.device, backend: AttentionBackend) -> None:
        self.config = config
        self.hf_config = hf_config
        self.model = model
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.block_size = kv_block_size(backend, config.block_size)
        self.batch: InputBatch | None = None
        self.kv: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self._last_end: torch.cuda.Event | None = None  # the last step's, on rank 0 on CUDA

    @classmethod
    def load(cls, config: RunnerConfig) -> "ModelRunner":
        if config.device == "cuda":
            # The host-side tensors of a step are tiny; a thread pool only adds wake-up costs
            # (measured on a 32-core host: 3 ms per repeat_interleave, most of a step's time).
            torch.set_num_threads(1)
            from dataplane.kernels import pdl  # triton: the CUDA path only
            pdl.set_enabled(config.pdl)
        hf_config = load_config(config.model_dir)
        dtype = resolve_dtype(config.dtype, hf_config)
        device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" \
            else torch.device("cpu")
        model = load_model(config.model_dir, hf_config, dtype, device, config.load_format)
        return cls(config, hf_config, model, dtype, device,
                   make_backend(config.attention_backend, config.device))

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    # -- set-up --------------------------------------------------------------------------------

    def configure(self, limits: link_pb2.Configure) -> int:
        """Size and allocate the KV cache and slot tables for these limits, capture the CUDA
        graphs; returns the number of KV blocks.

        Where auto picked triton_fa4 and FlashAttention-4 fails here (its first compiles run in
        the profiling step and the warm-up), a single-GPU runner falls back to triton on the
        same block size for good, and logs why: FA4 is optional, and its import alone does not
        show that its CuTe DSL can compile for this GPU. An explicit triton_fa4 raises, and so
        does TP > 1: a rank that fell back alone would leave the others waiting in a collective
        of the failed attempt."""
        try:
            return self._configure(limits)
        except Fa4Error as e:
            if self.config.attention_backend != "auto" or tp_size() > 1:
                raise
            error = str(e)  # not e: its frames hold the failed attempt's tensors
        log.warning("FlashAttention-4 failed at configure (%s): attention backend auto falls back "
                    "to triton on %d-token KV blocks", error, self.block_size)
        gc.collect()  # whatever of the failed attempt sits in reference cycles
        self.backend = make_backend("triton", self.config.device)
        return self._configure(limits)

    def _configure(self, limits: link_pb2.Configure) -> int:
        self.kv = self.graphs = self.mixed_graphs = self.batch = None  # free the old epoch's first
        self._last_end = None  # (the idle before an epoch's first step is not a step's)
        self._unbind_kv_cache()  # the layers' views would keep the old cache through the sizing
        batch_limits = BatchLimits(limits.max_num_seqs, limits.max_model_len,
                                   limits.max_num_batched_tokens, self.block_size, self.vocab_size)
        layers = self.model.attention_layers()
        per_block = kv_cache.bytes_per_block(layers, self.block_size, self.dtype)
        num_blocks = kv_cache.num_blocks_for(self._kv_budget(batch_limits), per_block,
                                             self.config.num_kv_blocks)
        self.kv = kv_cache.allocate_kv_cache(layers, num_blocks, self.block_size, self.dtype,
                                             self.device, self.backend)
        self.batch = InputBatch(batch_limits, self.device)
        if self.device.type == "cuda":  # every kernel variant a step launches (warmup.py)
            self._dummy_steps().compile_kernels(batch_limits, num_blocks, self.backend.name,
                                                is_rank0=tp_rank() == 0)
        if self._uses_graphs:  # each kept only once all of its sizes are captured
            graphs = DecodeGraphs(self.model, self.batch)
            graphs.capture()
            self.graphs = graphs
            if self._uses_prompt_graphs:
                attention = layers[0]
                mixed = MixedGraphs(self.model, limits.max_num_batched_tokens,
                                    attention.num_heads, attention.head_dim, self.dtype,
                                    self.device)
                mixed.capture()
                self.mixed_graphs = mixed
        return num_blocks

    @property
    def _uses_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and \
            self.backend.name != "torch"

    @property
    def _uses_prompt_graphs(self) -> bool:
        return self._uses_graphs and self.config.prompt_graphs

    def release(self) -> None:
        """Drop the model, KV cache and graphs, and give their device memory back (another
        process on the same GPU sizes its KV cache from what is free)."""
        self.kv = self.graphs = self.mixed_graphs = self.batch = None
        self.model = None
        gc.collect()  # whatever of it sits in reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _kv_budget(self, limits: BatchLimits) -> int:
        """Bytes for the KV cache. On CUDA: the configured share of the device, less what is in
        use (weights, context) and the peak of a worst-case step (a full prefill plus sampling
        max_num_seqs rows with every sampling feature), measured by running one, and what the
        CUDA graphs keep: 512 MB, plus that peak scaled to the prompt graphs' largest size and
        what those graphs hold besides (MixedGraphs.held_bytes); and the batch's token and
        block tables (InputBatch.device_bytes)."""
        if self.device.type == "cpu":
            return int(self.config.cpu_kv_cache_gib * (1 << 30))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self._profile_step(limits)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        graphs_and_slack = (512 << 20) + InputBatch.device_bytes(limits)
        if self._uses_prompt_graphs:
            # the prompt graphs' pool keeps one forward's activations at their largest size
            share = min(1.0, MAX_MIXED_TOKENS / limits.max_num_batched_tokens)
            attention = self.model.attention_layers()[0]
            graphs_and_slack += int(peak * share) + MixedGraphs.held_bytes(
                limits.max_num_batched_tokens, self.hf_config.hidden_size, attention.num_heads,
                attention.head_dim, self.dtype)
        return int(total * self.config.gpu_memory_utilization - (total - free) - peak
                   - graphs_and_slack)

    @torch.inference_mode()
    def _profile_step(self, limits: BatchLimits) -> None:
        num_tokens = limits.max_num_batched_tokens
        num_blocks = -(-num_tokens // self.block_size)
        layers = self.model.attention_layers()
        kv_cache.allocate_kv_cache(layers, num_blocks, self.block_size, self.dtype, self.device,
                                   self.backend)
        rows = min(limits.max_num_seqs, num_tokens)
        logits = self._dummy_steps().forward([num_tokens], num_blocks, rows)
        if logits is not None:  # every sampling feature at once
            batch = SamplingBatch.same_for_all(rows, self.device, top_k=50, top_p=0.9, min_p=0.1,
                                               penalty=1.0, repetition_penalty=1.1,
                                               max_logprobs=20)
            batch.output_counts = torch.zeros_like(logits, dtype=torch.float32)
            batch.prompt_mask = torch.zeros_like(logits, dtype=torch.bool)
            sample(logits, batch)
        self._unbind_kv_cache()

    def _dummy_steps(self) -> DummySteps:
        return DummySteps(self.model, self.device, self.block_size, self.hf_config.hidden_size,
                          self.vocab_size, self.dtype)

    def _unbind_kv_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(torch.empty(0), torch.empty(0), self.backend)

    # -- steps ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, step: link_pb2.Step) -> tuple[torch.Tensor | None, StepInputs | None]:
        """Apply the step's deltas and run the model. Returns the logits of the requests that
        reached the end of their tokens (on rank 0; None elsewhere) and the step's inputs
        (None for a step that only frees slots)."""
        assert self.batch is not None, "configure() before the first step"
        slots, num_computed, num_scheduled = self.batch.apply(step)
        if len(slots) == 0:
            return None, None
        inputs = self.batch.stage(slots, num_computed, num_scheduled)
        if self.graphs is not None and self.graphs.fits(inputs):
            return self.graphs.run(inputs), inputs
        inputs = self.batch.prepare(inputs)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(inputs):
            return self.mixed_graphs.run(inputs), inputs
        with forward_context(inputs.context):
            hidden = self.model(inputs.token_ids, inputs.positions)
            logits = self.model.compute_logits(hidden)
        return logits, inputs

    @torch.inference_mode()
    def submit(self, step: link_pb2.Step) -> PendingStep:
        """Launch the step on every rank: forward, sampling on rank 0, sampled tokens to every
        rank's token table and (rank 0) on their way to the host. Rank 0 on CUDA brackets the
        step with timing events (PendingStep.device_idle_ms, device_ms, done)."""
        started = time.perf_counter()
        timed = self.device.type == "cuda" and tp_rank() == 0
        device_start = _timing_event() if timed else None
        logits, inputs = self.forward(step)
        out, host_tokens = None, None
        sampled_slots = inputs.sampled_slots if inputs is not None else np.empty(0, np.int64)
        if len(sampled_slots):
            token_ids = torch.empty(len(sampled_slots), dtype=torch.int64, device=self.device)
            if tp_rank() == 0:
                out = sample(logits, self.batch.sampling_batch(inputs))
                token_ids = out.token_ids
            broadcast_from_rank0(token_ids)
            self.batch.append_sampled(inputs, token_ids)
            if tp_rank() == 0:
                host_tokens = self._to_host(token_ids)
        num_logprobs = None
        if out is not None and out.logprobs is not None:
            num_logprobs = self.batch.params.num_logprobs[sampled_slots]  # (a copy)
        end, previous_end = None, self._last_end
        if timed:
            end = self._last_end = _timing_event()
        return PendingStep(step.step_id, started, time.perf_counter(), sampled_slots, out,
                           host_tokens, num_logprobs, device_start, previous_end, end)

    def _to_host(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return token_ids
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host.copy_(token_ids, non_blocking=True)
        return host

    def finish(self, pending: PendingStep) -> link_pb2.StepResult | None:
        """Wait for a submitted step's tokens; rank 0 returns the result."""
        if tp_rank() != 0:
            return None
        if pending.done is not None:
            pending.done.synchronize()
        done = time.perf_counter()
        timings = link_pb2.Timings(forward_ms=1e3 * (pending.submitted - pending.started),
                                   sample_ms=1e3 * (done - pending.submitted),
                                   total_ms=1e3 * (done - pending.started),
                                   device_idle_ms=pending.device_idle_ms(),
                                   device_ms=pending.device_ms())
        tokens = pending.host_tokens.tolist() if pending.host_tokens is not None else []
        return _result(pending.step_id, tokens, pending.out, pending.num_logprobs, timings)

    def execute(self, step: link_pb2.Step) -> link_pb2.StepResult | None:
        return self.finish(self.submit(step))


def _timing_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _result(step_id: int, token_ids: list[int], out: SamplerOutput | None,
            num_logprobs: np.ndarray | None, timings: link_pb2.Timings) -> link_pb2.StepResult:
    result = link_pb2.StepResult(step_id=step_id, sampled_token_ids=pack_i32(token_ids),
                                 timings=timings)
    if out is None or out.logprobs is None:
        return result
    wanted = torch.from_numpy(num_logprobs)  # [rows]: -1 none, else N
    rows = (wanted >= 0).nonzero().squeeze(1)
    n = wanted[rows]
    keep = torch.arange(out.top_token_ids.shape[1]) < n.unsqueeze(1)  # [rows, max_n]
    result.sampled_logprobs = pack_f32(out.logprobs.cpu()[rows].tolist())
    result.top_token_ids = pack_i32(out.top_token_ids.cpu()[rows][keep].tolist())
    result.top_logprobs = pack_f32(out.top_logprobs.cpu()[rows][keep].tolist())
    return result
