"""Runs steps: applies a Step's deltas to the slot state, runs the model, samples on rank 0."""

import pathlib
import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from common.wire import pack_f32, pack_i32
from dataplane import kv_cache
from dataplane.attention import AttentionBackend, make_backend
from dataplane.distributed import broadcast_from_rank0, tp_rank
from dataplane.forward_context import forward_context
from dataplane.input_batch import BatchLimits, InputBatch
from dataplane.loader import load_config, load_model, resolve_dtype
from dataplane.sampler import SamplerOutput, sample
from protos import link_pb2


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: pathlib.Path
    device: str = "cpu"
    dtype: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # a cap on the KV cache, for small-memory runs and tests
    cpu_kv_cache_gib: float = 1.0  # KV cache budget on CPU

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, not {self.num_kv_blocks}")


class ModelRunner:
    def __init__(self, config: RunnerConfig, hf_config: PretrainedConfig, model: torch.nn.Module,
                 dtype: torch.dtype, device: torch.device, backend: AttentionBackend) -> None:
        self.config = config
        self.hf_config = hf_config
        self.model = model
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.batch: InputBatch | None = None
        self.kv: torch.Tensor | None = None

    @classmethod
    def load(cls, config: RunnerConfig) -> "ModelRunner":
        hf_config = load_config(config.model_dir)
        dtype = resolve_dtype(config.dtype, hf_config)
        device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" \
            else torch.device("cpu")
        model = load_model(config.model_dir, hf_config, dtype, device)
        return cls(config, hf_config, model, dtype, device,
                   make_backend(config.attention_backend, config.device))

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def configure(self, limits: link_pb2.Configure) -> int:
        """Allocate the KV cache and slot tables for these limits; returns the number of blocks."""
        layers = self.model.attention_layers()
        per_block = kv_cache.bytes_per_block(layers, self.config.block_size, self.dtype)
        budget = int(self.config.cpu_kv_cache_gib * (1 << 30))
        num_blocks = kv_cache.num_blocks_for(budget, per_block, self.config.num_kv_blocks)
        self.kv = None  # free the old cache before allocating a new one
        self.kv = kv_cache.allocate_kv_cache(layers, num_blocks, self.config.block_size,
                                             self.dtype, self.device, self.backend)
        self.batch = InputBatch(BatchLimits(limits.max_num_seqs, limits.max_model_len,
                                            self.config.block_size, self.vocab_size), self.device)
        return num_blocks

    @torch.inference_mode()
    def forward(self, step: link_pb2.Step) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Apply the step's deltas and run the model. Returns the logits of the requests that
        reached the end of their tokens (on rank 0; None elsewhere) and their slots."""
        assert self.batch is not None, "configure() before the first step"
        slots, num_computed, num_scheduled = self.batch.apply(step)
        if len(slots) == 0:
            return None, slots
        inputs = self.batch.prepare(slots, num_computed, num_scheduled)
        with forward_context(inputs.context):
            hidden = self.model(inputs.token_ids, inputs.positions)
            logits = self.model.compute_logits(hidden)
        return logits, inputs.sampled_slots

    @torch.inference_mode()
    def execute(self, step: link_pb2.Step) -> link_pb2.StepResult | None:
        """Run one step on every rank; rank 0 samples and returns the result."""
        start = time.perf_counter()
        logits, sampled_slots = self.forward(step)
        forward_done = time.perf_counter()
        out = None
        token_ids = torch.empty(len(sampled_slots), dtype=torch.int64, device=self.device)
        if len(sampled_slots):
            if tp_rank() == 0:
                out = sample(logits, self.batch.sampling_batch(sampled_slots))
                token_ids = out.token_ids
            broadcast_from_rank0(token_ids)
            self.batch.append_sampled(sampled_slots, token_ids.cpu())
        if tp_rank() != 0:
            return None
        done = time.perf_counter()
        timings = link_pb2.Timings(forward_ms=1e3 * (forward_done - start),
                                   sample_ms=1e3 * (done - forward_done), total_ms=1e3 * (done - start))
        return _result(step.step_id, token_ids, out, self.batch, sampled_slots, timings)


def _result(step_id: int, token_ids: torch.Tensor, out: SamplerOutput | None, batch: InputBatch,
            sampled_slots: torch.Tensor, timings: link_pb2.Timings) -> link_pb2.StepResult:
    result = link_pb2.StepResult(step_id=step_id, sampled_token_ids=pack_i32(token_ids.tolist()),
                                 timings=timings)
    if out is None or out.logprobs is None:
        return result
    wanted = batch.params.num_logprobs[sampled_slots]  # [rows]: -1 none, else N
    rows = (wanted >= 0).nonzero().squeeze(1)
    n = wanted[rows]
    keep = torch.arange(out.top_token_ids.shape[1]) < n.unsqueeze(1)  # [rows, max_n]
    result.sampled_logprobs = pack_f32(out.logprobs.cpu()[rows].tolist())
    result.top_token_ids = pack_i32(out.top_token_ids.cpu()[rows][keep].tolist())
    result.top_logprobs = pack_f32(out.top_logprobs.cpu()[rows][keep].tolist())
    return result
