"""Request streams: what the engine hands each request's consumer (an RPC, or the offline LLM),
and the queue that decides when a waiting consumer is woken for new tokens.

Writing a stream message costs the control plane tens of microseconds of CPU (a gRPC write is a
syscall on the loop's thread); with hundreds of streams that is most of a step's CPU, and it
shares the one loop with the engine. So a consumer waiting for tokens is not woken the moment
they arrive: its stream joins `Releases`, and after each step's result the engine wakes one
batch of the queue, then more while it waits for the data plane, stopping as soon as the next
answer is in, so the next step goes out first. While the control plane keeps up (or serves few
streams), every token still goes out at once; when it falls behind, the streams left in the
queue gather their tokens into fewer, larger messages instead of delaying the device. Tokens are never dropped or reordered, and a stream's last chunk (end,
abort, failure) wakes its consumer at once.
"""

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.request import FinishReason, Request
from controlplane.step_codec import TokenLogprobs
from controlplane.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
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


class Releases:
    """Streams whose waiting consumer has tokens to take, oldest first. The engine wakes them
    with `release`; a stream is queued at most once."""

    def __init__(self) -> None:
        self._streams: collections.deque[RequestStream] = collections.deque()

    def __len__(self) -> int:
        return len(self._streams)

    def queue(self, stream: "RequestStream") -> None:
        if not stream.is_queued:
            stream.is_queued = True
            self._streams.append(stream)

    def release(self, limit: int | None = None) -> None:
        """Wake the `limit` oldest (all by default)."""
        for _ in range(len(self._streams) if limit is None else min(limit, len(self._streams))):
            stream = self._streams.popleft()
            stream.is_queued = False
            stream.wake()


class RequestStream:
    """One request's output, consumed by its RPC. The engine adds each step's token; the consumer
    takes everything added since it last looked as one chunk, so a consumer that fell behind (its
    last message still being written, or its stream still queued in `releases`) sends fewer,
    larger messages instead of falling further behind. With `interval` > 1 it is woken only once
    that many tokens wait (or the request ended). Nothing is kept per token but the token, its
    text and its logprobs.

    Two kinds of consumer: a task iterating the stream (`async for`), or a sink (`push_to`), a
    function the engine's loop calls with each chunk where it would wake that task. A sink
    costs no task switch, future or generator frames per message: the engine process's
    front-end link serves every Generate call through one (~5 us of CPU a message less on
    bench/engine_cpu.py, for a hundred or more messages a step)."""

    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer,
                 releases: Releases, interval: int = 1) -> None:
        self.request = request
        self.detokenizer = detokenizer
        self.interval = interval
        self.releases = releases
        self.is_queued = False  # in `releases`
        self._token_ids: list[int] = []
        self._texts: list[str] = []
        self._logprobs: list[TokenLogprobs] = []
        self._last: Chunk | None = None  # set when the request ended: reason and usage
        self._waiter: asyncio.Future | None = None
        self._sink: Callable[[Chunk], None] | None = None

    def push_to(self, sink: Callable[[Chunk], None] | None) -> None:
        """Hand every chunk to `sink` (it must not raise: it runs on the engine's stack) instead
        of to an iterating consumer; the last one detaches it. None detaches it now (the
        call went away): nothing more is handed over."""
        assert self._waiter is None, "the stream already has an iterating consumer"
        self._sink = sink
        if sink is not None and self._ready():
            self.wake()

    def add(self, token_id: int, text: str, logprobs: TokenLogprobs | None) -> None:
        self._token_ids.append(token_id)
        if text:
            self._texts.append(text)
        if logprobs is not None:
            self._logprobs.append(logprobs)
        # (a consumer that waits, or a sink: it takes the tokens as soon as it is woken)
        if len(self._token_ids) >= self.interval and (self._waiter is not None or
                                                      self._sink is not None):
            self.releases.queue(self)

    def end(self, last: Chunk) -> None:
        """The request ended: `last` carries the reason and usage (and no tokens)."""
        self._last = last
        self.wake()

    def wake(self) -> None:
        if self._sink is not None:
            if self._ready():
                sink, chunk = self._sink, self._take()
                if chunk.finish_reason is not None:
                    self.push_to(None)
                sink(chunk)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _ready(self) -> bool:
        return len(self._token_ids) >= self.interval or self._last is not None

    def _take(self) -> Chunk:
        chunk = self._last or Chunk()
        chunk.token_ids, chunk.text, chunk.logprobs = \
            self._token_ids, "".join(self._texts), self._logprobs
        self._token_ids, self._texts, self._logprobs = [], [], []
        return chunk

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            if not self._ready():
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
                self._waiter = None
                continue
            chunk = self._take()
            last = chunk.finish_reason is not None
            yield chunk
            if last:
                return
