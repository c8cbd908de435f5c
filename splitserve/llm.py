"""The engine and the model runner in one process, without ZeroMQ or gRPC: an offline API in
the spirit of nano-vllm's `LLM.generate`, and the baseline that measures the cost of the split.

    llm = LLM("/models/Qwen3-0.6B", device="cuda")
    for completion in llm.generate(["Hello", [1, 2, 3]], max_tokens=32, temperature=0.6):
        print(completion.text)

The same Engine drives the same ModelRunner as in `splitserve serve`; only the transport is
gone (single rank: tensor parallelism needs the rank processes of the data plane).
"""

import asyncio
import dataclasses
import gc
import pathlib
import uuid
from collections.abc import Sequence

from common import process
from common.model_info import ModelInfo
from controlplane.dataplane_client import DataPlaneInfo
from controlplane.engine import Engine, EngineConfig
from controlplane.request import Request
from controlplane.scheduler import SchedulerConfig
from controlplane.tokenizer import Tokenizer
from controlplane.validation import Limits, sampling_params, validate_prompt
from dataplane.model_runner import ModelRunner, RunnerConfig
from protos import link_pb2
from splitserve.client import Completion, build_sampling


class InProcessDataPlane:
    """A DataPlaneClient over a ModelRunner in this process. A step is submitted at once (the
    device queues it behind the previous one) and awaited in a thread, so the engine keeps
    scheduling while the device works, as with a remote data plane."""

    def __init__(self, runner: ModelRunner, limits: link_pb2.Configure) -> None:
        self.runner = runner
        self.limits = limits
        self.info: DataPlaneInfo | None = None

    @property
    def is_attached(self) -> bool:
        return self.info is not None

    @property
    def last_loss_reason(self) -> str | None:
        return None  # (it is never lost: a failure here raises)

    async def attach(self) -> DataPlaneInfo:
        if self.info is None:
            num_blocks = self.runner.configure(self.limits)
            r = self.runner
            self.info = DataPlaneInfo(epoch=1, instance_id="in-process", num_kv_blocks=num_blocks,
                                      block_size=r.block_size, tp_size=1,
                                      dtype=str(r.dtype).removeprefix("torch."),
                                      device=r.config.device, attention_backend=r.backend.name)
        return self.info

    async def execute(self, step: link_pb2.Step, epoch: int, timeout_s: float) -> link_pb2.StepResult:
        pending = self.runner.submit(step)
        if not pending.is_done():
            await asyncio.to_thread(pending.done.synchronize)
        return self.runner.finish(pending)

    def drop(self, reason: str) -> None:
        """A result that did not fit its step: a bug here, not a remote fault; fail loudly."""
        raise RuntimeError(f"the in-process data plane answered what cannot be: {reason}")


class LLM:
    def __init__(self, model: str | pathlib.Path, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True,
                 pipeline_depth: int = EngineConfig.pipeline_depth,
                 tune_gc: bool = True, **runner_options) -> None:
        """`runner_options`: RunnerConfig's fields (device, dtype, block_size,
        gpu_memory_utilization, enforce_eager, attention_backend, load_format, ...).
        `pipeline_depth`: steps in flight at once, as serve's --pipeline-depth.
        `tune_gc`: make this process's garbage collector run less often, as the servers do
        (common.process.tune_gc); it is process-wide, so pass False to keep yours."""
        self.model = ModelInfo.from_dir(model)
        max_model_len = max_model_len or self.model.max_position_embeddings
        # Nobody reads the streams before they end: one chunk per request, not per token. (Built
        # before the weights load, so that a bad value fails first.)
        self.engine_config = EngineConfig(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                            enable_prefix_caching),
            stream_interval=max_model_len, pipeline_depth=pipeline_depth)
        self.runner = ModelRunner.load(RunnerConfig(model_dir=pathlib.Path(model), **runner_options))
        self.dataplane = InProcessDataPlane(self.runner, link_pb2.Configure(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, max_logprobs=20))
        self.tokenizer = Tokenizer.from_dir(model, self.model.vocab_size)
        self.engine: Engine | None = None
        self.loop = asyncio.new_event_loop()
        self._tuned_gc = tune_gc
        if tune_gc:
            process.tune_gc()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 per_prompt: Sequence[dict] | None = None, **sampling) -> list[Completion]:
        """Complete every prompt (all at once, continuous batching). `sampling` takes the
        SamplingParams field names, as the gRPC client does; `per_prompt` adds parameters that
        differ per prompt (one dict each)."""
        samplings = [{**sampling, **extra} for extra in per_prompt] if per_prompt is not None \
            else [sampling] * len(prompts)
        return self.loop.run_until_complete(self._generate(prompts, samplings))

    async def _generate(self, prompts, samplings: list[dict]) -> list[Completion]:
        if self.engine is None:
            self.engine = Engine(self.engine_config, self.tokenizer, self.dataplane)
            self._task = asyncio.ensure_future(self.engine.run())
        await self.dataplane.attach()
        while not self.engine.accepting:
            self._raise_if_stopped()
            await asyncio.sleep(0)
        # every prompt validated before any is added: one bad prompt leaves none running
        requests = [self._request(p, sampling) for p, sampling in zip(prompts, samplings,
                                                                         strict=True)]
        streams = [self.engine.add_request(request) for request in requests]
        completions = asyncio.gather(*(self._collect(s) for s in streams))
        # an engine loop that stops leaves its streams open: what stopped it is the answer
        await asyncio.wait({completions, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not completions.done():
            completions.cancel()
            await asyncio.gather(completions, return_exceptions=True)
            self._raise_if_stopped()
        return completions.result()

    def _raise_if_stopped(self) -> None:
        if self._task.done():
            self._task.result()  # its exception, if it has one
            raise RuntimeError("the engine loop stopped")

    def _request(self, prompt, sampling: dict) -> Request:
        info = self.dataplane.info
        max_model_len = self.engine_config.scheduler.max_model_len
        limits = Limits(max_model_len, self.model.vocab_size,
                        min(max_model_len, info.num_kv_blocks * info.block_size))
        # (the ids go straight to the Request: through a proto they took ~50 us a prompt)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_prompt(ids, "prompt", limits)
        return Request(uuid.uuid4().hex, ids,
                       sampling_params(build_sampling(**sampling), len(ids), limits),
                       self.model.eos_token_ids)

    @staticmethod
    async def _collect(stream) -> Completion:
        """The stream's chunks as a Completion; a request that failed in the engine ends with
        finish_reason "error" or "unavailable" (which the gRPC API reports as a status)."""
        from controlplane.api_server import chunk_to_proto
        completion = Completion()
        async for chunk in stream:
            reason = chunk.finish_reason
            completion.add(chunk_to_proto(stream.request.request_id,
                                          dataclasses.replace(chunk, finish_reason=None)))
            if reason is not None:
                completion.finish_reason = reason.value
                completion.prompt_tokens = chunk.num_prompt_tokens
                completion.completion_tokens = chunk.num_output_tokens
                completion.cached_tokens = chunk.num_cached_tokens
        return completion

    def close(self) -> None:
        """Stop the engine and free the device memory the model and KV cache held."""
        if self.engine is not None:
            self.engine.close()
            self.loop.run_until_complete(asyncio.gather(self._task, return_exceptions=True))
        self.loop.close()
        if self._tuned_gc:
            gc.unfreeze()  # what tune_gc froze (the model among it) can be collected again
        self.runner.release()
