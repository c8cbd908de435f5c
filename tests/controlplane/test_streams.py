"""Request streams and the release queue: a waiting consumer gets new tokens when the engine
releases its stream (oldest first), its last chunk at once, and nothing is lost or reordered."""

import asyncio

import pytest

from controlplane.request import FinishReason
from controlplane.streams import Chunk, Releases, RequestStream
from controlplane.tokenizer import Tokenizer
from dataplane.checkpoints import build_tokenizer
from tests.controlplane.factories import make_request

TOKENIZER = Tokenizer(build_tokenizer(320), 320)
pytestmark = pytest.mark.timeout(30)


def stream(request_id: str, releases: Releases) -> RequestStream:
    return RequestStream(make_request(request_id, [1, 2]), TOKENIZER.detokenizer(()), releases)


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_waiting_consumer_gets_its_tokens_when_released_oldest_first():
    async def main():
        releases = Releases()
        a, b = stream("a", releases), stream("b", releases)
        got = {"a": [], "b": []}

        async def consume(s):
            async for chunk in s:
                got[s.request.request_id].append(chunk.token_ids)
        tasks = [asyncio.create_task(consume(s)) for s in (a, b)]
        await turns()
        b.add(7, "", None)
        a.add(5, "", None)
        a.add(6, "", None)
        b.add(8, "", None)
        await turns()
        assert got == {"a": [], "b": []} and len(releases) == 2  # queued once each
        releases.release(1)  # b queued first
        await turns()
        assert got == {"a": [], "b": [[7, 8]]}
        releases.release()
        await turns()
        assert got == {"a": [[5, 6]], "b": [[7, 8]]} and len(releases) == 0
        a.add(9, "", None)
        a.end(Chunk(finish_reason=FinishReason.LENGTH))  # the end wakes at once, with the token
        b.end(Chunk(finish_reason=FinishReason.ABORTED))
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        releases.release()  # a's stale entry: harmless
        return got

    assert asyncio.run(main()) == {"a": [[5, 6], [9]], "b": [[7, 8], []]}


def test_a_sink_gets_each_chunk_when_released_and_the_last_at_once():
    """A sink (push_to) is handed what an iterating consumer would take, at the moment that
    consumer would be woken, on the caller's stack; the last chunk detaches it."""
    releases = Releases()
    a, b = stream("a", releases), stream("b", releases)
    a.add(4, "", None)  # before the sink: handed over as soon as it is attached
    got = {"a": [], "b": []}
    for s in (a, b):
        s.push_to(lambda chunk, s=s: got[s.request.request_id].append(
            (chunk.token_ids, chunk.finish_reason)))
    assert got == {"a": [([4], None)], "b": []}
    b.add(7, "", None)
    a.add(5, "", None)
    a.add(6, "", None)
    assert len(releases) == 2 and got["b"] == []  # queued once each, not yet handed over
    releases.release(1)
    assert got["b"] == [([7], None)]
    releases.release()
    assert got["a"] == [([4], None), ([5, 6], None)]
    a.add(9, "", None)
    a.end(Chunk(finish_reason=FinishReason.LENGTH))  # at once, with the token
    assert got["a"][-1] == ([9], FinishReason.LENGTH)
    a.add(10, "", None)  # (nothing comes after the end; were it to, nobody would take it)
    releases.release()
    assert len(got["a"]) == 3


def test_a_detached_sink_gets_nothing_more():
    releases = Releases()
    s = stream("a", releases)
    got = []
    s.push_to(got.append)
    s.add(1, "", None)
    s.push_to(None)  # the call went away
    releases.release()
    s.end(Chunk(finish_reason=FinishReason.ABORTED))
    assert got == []
