"""A request's state machine and its authoritative token history.

    WAITING --admit--> RUNNING --finish--> FINISHED
       ^                  |
       +----preempt-------+      (PREEMPTED waits again and is recomputed from its tokens)

The control plane keeps every token a request has (prompt and output), so a preempted request,
or every request after a data-plane loss, is recomputed from here.
"""

import enum
import time

from controlplane.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORTED = "aborted"
    ERROR = "error"
    UNAVAILABLE = "unavailable"  # the data plane was lost and none came back in time
    SHUTDOWN = "shutdown"  # the server stopped (SIGTERM) before the request finished


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        assert prompt_token_ids, "a request needs at least one prompt token"
        self.request_id = request_id
        self.sampling = sampling
        self.eos_token_ids = () if sampling.ignore_eos else eos_token_ids
        self.token_ids = list(prompt_token_ids)  # prompt, then output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV the data plane holds (or will, once
        # the step in flight returns)
        # Tokens sampled in steps still in flight: counted when scheduling ahead, their values
        # arrive with the steps' results.
        self.num_pending_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.status = RequestStatus.WAITING
        self.is_finished = False  # status is FINISHED (read once per request per step)
        self.finish_reason: FinishReason | None = None
        self.slot: int | None = None
        self.num_preemptions = 0
        # In a step that failed on the data plane: runs alone until it gets a token through,
        # so a request that crashes data planes is told apart from its batch-mates.
        self.is_suspect = False
        self.num_solo_failures = 0  # steps it failed alone since its last token
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None  # (controlplane/metrics.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is still to compute, counting tokens still in flight; 0 once every
        token the request may get is accounted for."""
        known = len(self.token_ids) + self.num_pending_tokens
        if known - self.num_prompt_tokens >= self.sampling.max_tokens:
            return 0
        return known - self.num_computed_tokens

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        assert self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), self.status
        self.status = RequestStatus.RUNNING
        self.slot = slot
        self.num_computed_tokens = num_cached_tokens
        if self.num_cached_tokens is None:
            self.num_cached_tokens = num_cached_tokens

    def preempt(self) -> None:
        """Back to waiting; its KV is gone and it will be recomputed from its tokens."""
        assert self.status is RequestStatus.RUNNING, self.status
        self.status = RequestStatus.PREEMPTED
        self.slot = None
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def finish(self, reason: FinishReason) -> None:
        assert self.status is not RequestStatus.FINISHED, f"{self.request_id} finished twice"
        self.status = RequestStatus.FINISHED
        self.is_finished = True
        self.finish_reason = reason
        self.slot = None

    def stopped_by_its_last_token(self) -> None:
        """Its last token, which ended it (length, EOS), also completed a stop string: that cut
        the text, so the reason is STOP (as in vLLM)."""
        assert self.status is RequestStatus.FINISHED, self.status
        self.finish_reason = FinishReason.STOP

    def append_output(self, token_id: int) -> FinishReason | None:
        """Record a sampled token (one preempted while its step was in flight still gets it);
        returns why the request is done, if it is."""
        assert self.status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED), self.status
        assert self.num_pending_tokens > 0, "a token nobody scheduled"
        self.num_pending_tokens -= 1
        self.token_ids.append(token_id)
        num_output, sampling = len(self.token_ids) - self.num_prompt_tokens, self.sampling
        if num_output < sampling.min_tokens:
            return None
        if token_id in sampling.stop_token_ids:
            return FinishReason.STOP
        if token_id in self.eos_token_ids:
            return FinishReason.EOS
        if num_output >= sampling.max_tokens:
            return FinishReason.LENGTH
        return None
