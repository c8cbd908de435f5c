"""The engine loop: schedule a step, run it on the data plane, turn the sampled tokens into
stream chunks. Talks to the data plane only through the DataPlaneClient interface.

Attachment (one state machine, transitions in named methods):

    DETACHED --attach--> ATTACHED --loss--> REATTACHING --attach--> ATTACHED
                                                 |
                                                 +--reattach timeout--> DETACHED

On a loss every running request goes back to the queue (all its tokens are here) and is
recomputed on the next data plane; streams continue where they were. New requests are accepted
while ATTACHED or REATTACHING and fail at once (UNAVAILABLE) while DETACHED or draining.
"""

import asyncio
import collections
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field

from controlplane.dataplane_client import DataPlaneClient, DataPlaneInfo, DataPlaneLost
from controlplane.deadline import StepDeadline
from controlplane.kv_manager import KVCacheManager
from controlplane.metrics import RequestMetrics
from controlplane.request import FinishReason, Request
from controlplane.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from controlplane.step_codec import MalformedResult, TokenLogprobs, decode_result, encode_step
from controlplane.streams import Chunk, Releases, RequestStream
from controlplane.tokenizer import Tokenizer
from protos import link_pb2

log = logging.getLogger("splitserve.engine")
_RELEASE_BATCH = 16  # streams woken per turn of the loop while a step runs


@dataclass
class KindTimes:
    """One kind of step's data-plane timings (StepResult.timings), summed."""

    num_steps: int = 0
    host_s: float = 0.0
    total_s: float = 0.0
    device_idle_s: float = 0.0
    device_s: float = 0.0


@dataclass
class StepTimes:
    """The data plane's own timings of its steps, by kind: prompt steps have a request with more
    than one new token (they run without CUDA graphs), decode steps do not. GetLoad reports
    them. The device's work counts for every step; its idle time only before steps sent while
    another was in flight, the steps the pipeline should have kept the device busy for. A step
    sent with none in flight mostly follows a wait for work (an idle server, a new request); the
    rare pipeline break with live requests (one waiting for a token still in flight) is left out
    with them."""

    prompt: KindTimes = field(default_factory=KindTimes)
    decode: KindTimes = field(default_factory=KindTimes)

    def observe(self, is_prompt_step: bool, timings: link_pb2.Timings,
                is_behind_another: bool) -> None:
        kind = self.prompt if is_prompt_step else self.decode
        kind.num_steps += 1
        kind.host_s += timings.forward_ms / 1e3
        kind.total_s += timings.total_ms / 1e3
        kind.device_s += timings.device_ms / 1e3
        if is_behind_another:
            kind.device_idle_s += timings.device_idle_ms / 1e3


class Attachment(enum.Enum):
    DETACHED = "detached"
    ATTACHED = "attached"
    REATTACHING = "reattaching"


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # After a loss, how long requests wait for a data plane before they end UNAVAILABLE.
    reattach_timeout_s: float = 30.0
    step_timeout_cap_s: float = 120.0
    # A request that was alone in this many steps that failed on the data plane, with no token
    # between, fails (INTERNAL), so one poisonous request cannot crash data planes forever.
    max_step_failures: int = 2
    # Steps in flight at once: with 2, the next step is scheduled and sent while the data plane
    # runs the current one, so neither side waits for the other (tokens still in flight are
    # placeholders in the scheduler). 3 keeps one more queued on the device, so that a late
    # turnaround on the host (a GC pause, a burst of arrivals) still finds the device busy: on
    # an H200 it gave split / in-process 0.996-1.010 against 2's 0.969-0.998 (bench/README.md).
    pipeline_depth: int = 3
    # A stream's consumer is woken once this many tokens wait (or its last chunk): fewer, larger
    # stream messages for less CPU per token, at the cost of smoothness (vLLM's --stream-interval).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        bad = [f"{name} ({value})" for name, value, low in (
            ("reattach_timeout_s", self.reattach_timeout_s, 0),
            ("max_step_failures", self.max_step_failures, 1),
            ("pipeline_depth", self.pipeline_depth, 1),
            ("stream_interval", self.stream_interval, 1)) if value < low]
        if bad:
            raise ValueError(f"{', '.join(bad)}: need reattach_timeout_s >= 0, and "
                             "max_step_failures, pipeline_depth, stream_interval >= 1")


class NotAccepting(Exception):
    """The engine takes no new requests now (no data plane, or draining)."""


@dataclass
class _InFlight:
    step_id: int
    out: SchedulerOutput
    num_tokens: int
    reply: asyncio.Task
    started: float
    is_behind_another: bool  # another step was in flight when this one was sent


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, dataplane: DataPlaneClient,
                 on_state_change=None) -> None:
        self.config = config
        self._on_state_change = on_state_change or (lambda: None)
        self.tokenizer = tokenizer
        self.dataplane = dataplane
        self.scheduler: Scheduler | None = None  # built at the first attach (the KV size)
        self.info: DataPlaneInfo | None = None
        self.attachment = Attachment.DETACHED
        self.draining = False
        self._closing = False
        self.streams: dict[str, RequestStream] = {}
        self.releases = Releases()  # streams whose consumer waits for tokens it can have
        self.deadline = StepDeadline(cap_s=config.step_timeout_cap_s)
        self.num_preemptions = 0
        self.num_dataplane_losses = 0
        self.num_steps = 0
        self.step_times = StepTimes()
        self.metrics = RequestMetrics()
        self._wakeup = asyncio.Event()
        self._closed = asyncio.Event()  # set by close(): wakes a run() waiting to attach
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_cut = asyncio.Event()  # (cut_drain)
        self._step_ids = itertools.count(1)
        self._last_step_id = 0  # the last step sent in this epoch
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._reattach_timer: asyncio.Task | None = None

    # -- API -----------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self.attachment is not Attachment.DETACHED and not self.draining

    @property
    def is_attached(self) -> bool:
        return self.attachment is Attachment.ATTACHED

    @property
    def is_serving(self) -> bool:
        """What health reports: a data plane is attached and the engine is not draining."""
        return self.attachment is Attachment.ATTACHED and not self.draining

    def add_request(self, request: Request) -> RequestStream:
        if not self.accepting:
            raise NotAccepting("draining" if self.draining else "no data plane is attached")
        assert request.request_id not in self.streams, "request ids are unique among live requests"
        stream = RequestStream(request, self.tokenizer.detokenizer(request.sampling.stop),
                               self.releases, self.config.stream_interval)
        self.streams[request.request_id] = stream
        self._idle.clear()
        self.scheduler.add(request)
        self.metrics.admitted(request)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> bool:
        """End a live request; idempotent. Its blocks are freed now; the stream gets its last chunk."""
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        self.scheduler.finish(stream.request, reason)
        self._end(stream, reason)
        return True

    def load(self) -> tuple[int, int, int, int]:
        """(num_running, num_waiting, kv_blocks_used, kv_blocks_total)."""
        s = self.scheduler
        if s is None:
            return 0, 0, 0, 0
        return len(s.running), len(s.waiting), s.kv.num_used_blocks, s.kv.num_blocks

    def num_queued(self, num_new: int = 0) -> int:
        """Requests waiting beyond the free sequence slots (Scheduler.num_queued)."""
        return 0 if self.scheduler is None else self.scheduler.num_queued(num_new)

    def on_link_change(self, attached: bool) -> None:
        """The link saw a data plane come or go. A loss wakes the loop so an idle engine notices
        it now, not at its next step."""
        if not attached:
            self._wakeup.set()

    async def drain(self, timeout_s: float) -> int:
        """Stop accepting, let live requests finish for up to `timeout_s`, end the rest
        UNAVAILABLE. Returns how many were cut off."""
        self.draining = True
        self._on_state_change()
        waits = [asyncio.ensure_future(event.wait()) for event in (self._idle, self._drain_cut)]
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        cut = list(self.streams)
        for request_id in cut:
            self.abort(request_id, FinishReason.SHUTDOWN)
        return len(cut)

    def cut_drain(self) -> None:
        """End a drain now (a second SIGTERM or Ctrl-C): its live requests end as at its
        timeout."""
        self._drain_cut.set()

    def close(self) -> None:
        """Make run() return at its next turn. (Cancelling it is not enough on Python 3.11:
        asyncio.wait_for can swallow a cancellation that races with its result.)"""
        self._closing = True
        self.releases.release()
        for step in self._in_flight:
            step.reply.cancel()
        self._wakeup.set()
        self._closed.set()

    # -- attachment ----------------------------------------------------------------------------

    async def run(self) -> None:
        while not self._closing:
            info = await self._attach_or_close()
            if info is None:
                return
            self._attach(info)
            try:
                await self._serve(info.epoch)
            except DataPlaneLost as e:
                if not self._closing:
                    self._lose(e)

    async def _attach_or_close(self) -> DataPlaneInfo | None:
        attach = asyncio.ensure_future(self.dataplane.attach())
        closing = asyncio.ensure_future(self._closed.wait())
        await asyncio.wait({attach, closing}, return_when=asyncio.FIRST_COMPLETED)
        closing.cancel()
        if self._closing:
            attach.cancel()
            return None
        return attach.result()

    def _attach(self, info: DataPlaneInfo) -> None:
        kv = KVCacheManager(info.num_kv_blocks, info.block_size,
                            self.config.scheduler.enable_prefix_caching)
        if self.scheduler is None:
            self.scheduler = Scheduler(self.config.scheduler, kv)
        else:
            self.scheduler.reset_kv(kv)
        if self._reattach_timer is not None:
            self._reattach_timer.cancel()
            self._reattach_timer = None
        self.info = info
        self._last_step_id = 0
        self.deadline.reset()
        self.attachment = Attachment.ATTACHED
        self._wakeup.set()
        self._on_state_change()

    def _lose(self, error: DataPlaneLost) -> None:
        assert self.attachment is Attachment.ATTACHED
        self.num_dataplane_losses += 1
        self.releases.release()
        failed = [s for s in self._in_flight if s.step_id == error.failed_step_id]
        if failed:  # (every step in flight failed with this error: the one it names is to blame)
            self._blame(failed[0].out)
        for step in self._in_flight:
            step.reply.cancel()
        self._in_flight.clear()
        lost = self.scheduler.preempt_all()
        if lost:
            log.warning("data plane lost (%s); %d running requests wait up to %.0fs for another",
                        error, len(lost), self.config.reattach_timeout_s)
        else:
            log.warning("data plane lost (%s); no requests were running", error)
        self.attachment = Attachment.REATTACHING
        self._reattach_timer = asyncio.create_task(self._give_up_after_timeout())
        self._on_state_change()

    def _blame(self, out: SchedulerOutput) -> None:
        """The step failed on the data plane: its requests become suspects, which run alone
        from now on until they get a token through; one that fails alone max_step_failures
        times with no token between is the culprit and fails."""
        requests = [s.request for s in out.scheduled if not s.request.is_finished]
        for request in requests:
            request.is_suspect = True
        if len(requests) != 1:
            return
        culprit = requests[0]
        culprit.num_solo_failures += 1
        if culprit.num_solo_failures >= self.config.max_step_failures:
            log.error("request %s failed %d steps alone; failing it", culprit.request_id,
                      culprit.num_solo_failures)
            self.abort(culprit.request_id, FinishReason.ERROR)

    async def _give_up_after_timeout(self) -> None:
        await asyncio.sleep(self.config.reattach_timeout_s)
        if self.attachment is not Attachment.REATTACHING:
            return
        if self.streams:
            log.error("no data plane within %.0fs; ending %d requests UNAVAILABLE",
                      self.config.reattach_timeout_s, len(self.streams))
        else:
            log.warning("no data plane within %.0fs: not serving until one attaches",
                        self.config.reattach_timeout_s)
        self.attachment = Attachment.DETACHED
        for request_id in list(self.streams):
            self.abort(request_id, FinishReason.UNAVAILABLE)
        self._on_state_change()

    # -- steps ---------------------------------------------------------------------------------

    async def _serve(self, epoch: int) -> None:
        while not self._closing:
            if not self._in_flight and not self.dataplane.is_attached:
                # (with steps in flight, their replies say what happened, e.g. which one failed)
                raise DataPlaneLost(self.dataplane.last_loss_reason or "no reason given")
            while len(self._in_flight) < self.config.pipeline_depth and self._launch(epoch):
                pass
            if not self._in_flight:
                self.releases.release()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Consumers take their tokens now, after the next step has gone out: one batch, then
            # more until this step's answer is in (controlplane/streams.py says why).
            step = self._in_flight[0]
            while self.releases:
                self.releases.release(_RELEASE_BATCH)
                await asyncio.sleep(0)
                if step.reply.done():
                    break
            try:
                result = await step.reply
            except asyncio.CancelledError:
                if self._closing:  # close() cancelled the step's reply
                    return
                raise
            if self._closing:
                return
            try:
                tokens, logprobs = decode_result(result, step.out, self.tokenizer.vocab_size)
            except MalformedResult as e:
                self.dataplane.drop(str(e))
                raise DataPlaneLost(str(e)) from None
            self._in_flight.popleft()
            self.num_steps += 1
            self.deadline.observe(step.num_tokens, time.monotonic() - step.started)
            self.step_times.observe(step.num_tokens > len(step.out.scheduled), result.timings,
                                    step.is_behind_another)
            self._process(step.out, tokens, logprobs)

    def _launch(self, epoch: int) -> bool:
        """Schedule a step and send it; False when there is nothing to send."""
        out = self.scheduler.schedule() if self.scheduler.has_work else None
        for request in out.failed if out else ():
            log.error("request %s needs more KV blocks than the data plane has", request.request_id)
            self._end(self.streams[request.request_id], FinishReason.ERROR)
        if out is None or not (out.scheduled or out.freed_slots):
            return False
        self.num_preemptions += out.num_preempted
        num_tokens = out.num_batched_tokens
        # A step waits behind the ones sent before it: its deadline covers them too.
        queued = num_tokens + sum(s.num_tokens for s in self._in_flight)
        step = encode_step(next(self._step_ids), self._last_step_id, out)
        self._last_step_id = step.step_id
        reply = asyncio.ensure_future(self.dataplane.execute(
            step, epoch, self.deadline.timeout_for(queued)))
        self._in_flight.append(_InFlight(step.step_id, out, num_tokens, reply, time.monotonic(),
                                         bool(self._in_flight)))
        return True

    def _process(self, out: SchedulerOutput, tokens: list[int],
                 logprobs: list[TokenLogprobs | None]) -> None:
        produced = self.scheduler.update(out, tokens)  # (not tokens of requests that ended)
        self.metrics.num_generation_tokens += len(produced)
        for request, index in produced:
            try:
                self._emit(request, tokens[index], logprobs[index])
            except Exception:  # a fault in one request's processing fails that request only
                log.exception("request %s failed while processing its output", request.request_id)
                if request.request_id in self.streams:
                    self.abort(request.request_id, FinishReason.ERROR)

    def _emit(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        stream = self.streams[request.request_id]
        if request.first_token_time is None:
            self.metrics.first_token(request)
        # stop strings count once min_tokens tokens came, like stop token ids (vLLM's rule)
        text, stopped = stream.detokenizer.add(
            token, may_stop=request.num_output_tokens > request.sampling.min_tokens)
        if stopped and not request.is_finished:
            self.scheduler.finish(request, FinishReason.STOP)
        elif stopped:  # by its last token allowed, say, which also completed a stop string
            request.stopped_by_its_last_token()
        if request.is_finished:
            if not stopped:
                text += stream.detokenizer.flush()
            stream.add(token, text, logprobs)
            self._end(stream, request.finish_reason)
        else:
            stream.add(token, text, logprobs)

    def _end(self, stream: RequestStream, reason: FinishReason) -> None:
        request = stream.request
        self.metrics.finished(request, reason)
        stream.end(Chunk(finish_reason=reason, num_prompt_tokens=request.num_prompt_tokens,
                         num_output_tokens=request.num_output_tokens,
                         num_cached_tokens=request.num_cached_tokens or 0))
        del self.streams[request.request_id]
        if not self.streams:
            self._idle.set()
