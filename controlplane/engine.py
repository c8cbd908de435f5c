"""The engine loop: schedule a step, run it on the data plane, turn the sampled tokens into
stream chunks. Talks to the data plane only through the DataPlaneClient interface.

On a data-plane loss every running request goes back to the queue (its tokens are all here)
and is recomputed on the next data plane; streams continue where they were.
"""

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

from controlplane.dataplane_client import DataPlaneClient, DataPlaneInfo, DataPlaneLost
from controlplane.kv_manager import KVCacheManager
from controlplane.request import FinishReason, Request
from controlplane.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from controlplane.step_codec import TokenLogprobs, decode_result, encode_step
from controlplane.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("splitserve.engine")


@dataclass
class Chunk:
    """What one step adds to one request's stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # usage, on the last chunk
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


class RequestStream:
    """One request's chunks, consumed by its RPC. Bounded by construction: the engine puts at most
    one chunk per step and a request lives at most max_tokens steps."""

    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer) -> None:
        self.request = request
        self.detokenizer = detokenizer
        self.queue: asyncio.Queue[Chunk] = asyncio.Queue()

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        while True:
            chunk = await self.queue.get()
            yield chunk
            if chunk.finish_reason is not None:
                return


class Engine:
    def __init__(self, config: SchedulerConfig, tokenizer: Tokenizer,
                 dataplane: DataPlaneClient) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.dataplane = dataplane
        self.scheduler: Scheduler | None = None  # one per attached data plane (its KV size)
        self.info: DataPlaneInfo | None = None
        self.streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._step_ids = itertools.count(1)
        self._pending: list[Request] = []  # arrived while no data plane was attached
        self.num_preemptions = 0
        self.num_dataplane_losses = 0

    # -- API -----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> RequestStream:
        assert request.request_id not in self.streams, "request ids are unique among live requests"
        stream = RequestStream(request, self.tokenizer.detokenizer(request.sampling.stop))
        self.streams[request.request_id] = stream
        if self.scheduler is not None:
            self.scheduler.add(request)
        else:
            self._pending.append(request)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> bool:
        """End a live request; idempotent. Its blocks are freed now; the stream gets its last chunk."""
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        request = stream.request
        if self.scheduler is not None:
            self.scheduler.finish(request, reason)
        else:
            self._pending.remove(request)
            request.finish(reason)
        self._end(stream, Chunk(), reason)
        return True

    def load(self) -> tuple[int, int, int, int]:
        """(num_running, num_waiting, kv_blocks_used, kv_blocks_total)."""
        s = self.scheduler
        if s is None:
            return 0, len(self._pending), 0, 0
        return len(s.running), len(s.waiting), s.kv.num_used_blocks, s.kv.num_blocks

    # -- loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            info = await self.dataplane.attach()
            self._start_epoch(info)
            try:
                await self._serve(info.epoch)
            except DataPlaneLost as e:
                lost = self.scheduler.preempt_all()
                self.num_dataplane_losses += 1
                log.warning("data plane lost (%s); %d running requests will be recomputed", e, len(lost))

    def _start_epoch(self, info: DataPlaneInfo) -> None:
        kv = KVCacheManager(info.num_kv_blocks, info.block_size, self.config.enable_prefix_caching)
        if self.scheduler is None:
            self.scheduler = Scheduler(self.config, kv)
            for request in self._pending:
                self.scheduler.add(request)
            self._pending.clear()
        else:
            self.scheduler.reset_kv(kv)
        self.info = info

    async def _serve(self, epoch: int) -> None:
        while True:
            out = self.scheduler.schedule() if self.scheduler.has_work else None
            for request in out.failed if out else ():
                log.error("request %s needs more KV blocks than the data plane has", request.request_id)
                self._end(self.streams[request.request_id], Chunk(), FinishReason.ERROR)
            if out is None or not (out.scheduled or out.freed_slots):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self.num_preemptions += out.num_preempted
            result = await self.dataplane.execute(encode_step(next(self._step_ids), out), epoch)
            self._process(out, result)
            await asyncio.sleep(0)  # let RPCs run between steps

    def _process(self, out: SchedulerOutput, result) -> None:
        tokens, logprobs = decode_result(result, out)
        produced = self.scheduler.update(out, tokens)
        for request, index in produced:
            stream = self.streams[request.request_id]
            text, stopped = stream.detokenizer.add(tokens[index])
            chunk = Chunk([tokens[index]], text, [logprobs[index]] if logprobs[index] else [])
            if stopped and not request.is_finished:
                self.scheduler.finish(request, FinishReason.STOP)
            if request.is_finished:
                if not stopped:
                    chunk.text += stream.detokenizer.flush()
                self._end(stream, chunk, request.finish_reason)
            else:
                stream.queue.put_nowait(chunk)

    def _end(self, stream: RequestStream, chunk: Chunk, reason: FinishReason) -> None:
        request = stream.request
        chunk.finish_reason = reason
        chunk.num_prompt_tokens = request.num_prompt_tokens
        chunk.num_output_tokens = request.num_output_tokens
        chunk.num_cached_tokens = request.num_cached_tokens or 0
        stream.queue.put_nowait(chunk)
        del self.streams[request.request_id]
