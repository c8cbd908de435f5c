"""Continuous batching with chunked prefill and preemption by recompute, FCFS.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running requests are served first, in arrival order: a decode takes one token, an unfinished
prefill takes the next chunk of its prompt, so prefill chunks share steps with decodes. When a
running request needs a block and none is free, the newest running request is preempted (its
blocks freed, to be recomputed later) until the older one fits. Waiting requests are admitted
after that, in arrival order, starting from their longest cached prefix, as long as budget,
slots and blocks allow and no request was preempted in this step.

A suspect request (it was in a step that failed on the data plane) runs alone: while one is
running or first in the queue, steps hold only that request, until it has sampled a token.
Runners preempted to make room for it queue behind it.
"""

from collections import deque
from dataclasses import dataclass, field

from controlplane.kv_manager import NO_HIT, KVCacheManager
from controlplane.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int
    new_block_ids: list[int]
    is_new: bool  # first step of the request in this epoch: the data plane gets all its tokens
    samples: bool  # the scheduled tokens reach the end of the known tokens: a token comes back


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    freed_slots: list[int] = field(default_factory=list)
    num_preempted: int = 0
    # Requests finished with FinishReason.ERROR because they can never fit in the KV cache.
    failed: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.freed_slots and not self.failed


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._freed_slots: list[int] = []  # released since the last step was built
        self._failed: list[Request] = []  # too large for the KV cache, not yet reported
        self._is_out_of_blocks = False  # the last step left requests waiting for KV blocks

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def num_queued(self, num_new: int = 0) -> int:
        """Waiting requests, with `num_new` more, beyond the sequence slots free now: those that
        would still wait if the next steps admitted one into every free slot. The API bounds
        this, not the waiting queue, so that a burst that fits the running set is not refused
        before a step has admitted it. While the KV cache is what holds requests back (the last
        step could not admit one for blocks, or preempted one) no slot counts as free."""
        num_free = 0 if self._is_out_of_blocks else self.config.max_num_seqs - len(self.running)
        return max(0, len(self.waiting) + num_new - num_free)

    @property
    def has_work(self) -> bool:
        """Something to schedule or to report."""
        return bool(self.waiting or self.running or self._failed)

    def add(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING
        self.waiting.append(request)
        self._fail_if_too_large(request)

    def _fail_if_too_large(self, request: Request) -> None:
        """A request whose prompt + max_tokens needs more blocks than exist would preempt itself
        forever; it fails at once instead. (The API rejects such requests up front; this covers
        a data plane that comes back with a smaller cache.)"""
        max_tokens = request.num_prompt_tokens + request.sampling.max_tokens
        if -(-max_tokens // self.kv.block_size) > self.kv.num_blocks:
            self.finish(request, FinishReason.ERROR)
            self._failed.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        suspect = self._suspect()
        if suspect is not None:
            self._schedule_alone(out, suspect, budget)
        else:
            budget = self._schedule_running(out, budget)
            self._is_out_of_blocks = out.num_preempted > 0
            if out.num_preempted == 0:
                self._schedule_waiting(out, budget)
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_tokens
            s.samples = request.num_computed_tokens == \
                len(request.token_ids) + request.num_pending_tokens
            request.num_pending_tokens += s.samples
        out.freed_slots, self._freed_slots = self._freed_slots, []
        out.failed, self._failed = self._failed, []
        return out

    def _suspect(self) -> Request | None:
        """The suspect to run alone: a running one (at most one runs), else the queue's head."""
        for request in self.running:
            if request.is_suspect:
                return request
        if self.waiting and self.waiting[0].is_suspect:
            return self.waiting[0]
        return None

    def _schedule_alone(self, out: SchedulerOutput, request: Request, budget: int) -> None:
        if request.status is RequestStatus.RUNNING:
            self._schedule_running(out, budget, only=request)
            return
        while not self.free_slots or not self._schedule_waiting(out, budget, limit=1):
            if not self.running:
                return  # it does not fit even alone: _fail_if_too_large covers that case
            # queued behind the suspect (the head), which is the one to take its blocks
            self._preempt(self.running[-1], queue_at=1)
            out.num_preempted += 1

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          only: Request | None = None) -> int:
        running, scheduled, allocate = self.running, out.scheduled, self.kv.allocate
        i = 0
        while i < len(running) and budget > 0:  # (preemption shortens `running` from the end)
            request = running[i]
            i += 1
            if only is not None and request is not only:
                continue
            num_tokens = min(request.num_tokens_to_compute, budget)
            if num_tokens <= 0:
                continue
            block_ids = allocate(request, num_tokens)
            while block_ids is None:
                victim = running[-1] if running[-1] is not only else running[-2]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    return budget
                block_ids = allocate(request, num_tokens)
            scheduled.append(ScheduledRequest(request, num_tokens, block_ids, False, False))
            budget -= num_tokens
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, limit: int | None = None) -> int:
        """Admit waiting requests in order while they fit; returns how many were admitted."""
        admitted = 0
        while self.waiting and budget > 0 and self.free_slots and admitted != limit:
            request = self.waiting[0]
            if request.is_suspect and limit is None:
                break  # it will run alone, once it is at the head of the queue
            if request.num_pending_tokens:
                break  # preempted with a step in flight: back once that token is known
            hit = self.kv.find_prefix(request) if self.kv.enable_prefix_caching else NO_HIT
            num_tokens = min(request.num_tokens - hit.num_tokens, budget)
            block_ids = self.kv.allocate(request, num_tokens, hit)
            if block_ids is None:
                self._is_out_of_blocks = True
                break
            self.waiting.popleft()
            request.admit(self.free_slots.pop(), hit.num_tokens)
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_tokens, block_ids, True, False))
            budget -= num_tokens
            admitted += 1
        return admitted

    def _preempt(self, request: Request, queue_at: int = 0) -> None:
        """Back to the queue, at its head unless queue_at says further down."""
        self.running.remove(request)
        slot = request.slot
        request.preempt()
        self._release(request, slot)
        self.waiting.insert(queue_at, request)

    def _release(self, request: Request, slot: int | None) -> None:
        """Give back the request's blocks and its data-plane slot (after its state changed, so
        the KV manager knows whether to forget the request)."""
        self.kv.free(request)
        if slot is not None:
            self.free_slots.append(slot)
            self._freed_slots.append(slot)

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[tuple[Request, int]]:
        """Apply a step's sampled tokens (one per scheduled request that samples, in order).
        Returns (request, index into sampled_token_ids) for each live request that got a token;
        requests that end here (length, EOS, stop id) are finished and released."""
        produced = []
        index = -1
        for s in out.scheduled:
            index += s.samples
            request = s.request
            if request.is_finished:  # ended while the step was in flight
                continue
            if request.status is RequestStatus.RUNNING:
                self.kv.cache_computed_blocks(request)
            if not s.samples:
                continue
            produced.append((request, index))
            if request.is_suspect:  # it got a token through: its failures alone are forgiven
                request.is_suspect = False
                request.num_solo_failures = 0
            reason = request.append_output(sampled_token_ids[index])
            if reason is not None:
                self.finish(request, reason)
        assert index == len(sampled_token_ids) - 1, "sampled tokens do not match the step"
        return produced

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request wherever it is (running or waiting) and free what it holds."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        slot = request.slot
        request.finish(reason)
        self._release(request, slot)

    def preempt_all(self) -> list[Request]:
        """After a data-plane loss: every running request goes back to waiting, ahead of the
        queue and in its order, to be recomputed; tokens of steps in flight will never come.
        Returns them."""
        lost = list(self.running)
        for request in reversed(lost):
            self._preempt(request)
        for request in self.waiting:
            request.num_pending_tokens = 0
        self._freed_slots = []
        return lost

    def reset_kv(self, kv: KVCacheManager) -> None:
        """A new data plane: a new (empty) KV cache. Only valid with nothing running."""
        assert not self.running, "preempt_all() first"
        self.kv = kv
        self.free_slots = list(range(self.config.max_num_seqs - 1, -1, -1))
        self._is_out_of_blocks = False
        self._freed_slots = []
        for request in list(self.waiting):
            self._fail_if_too_large(request)
