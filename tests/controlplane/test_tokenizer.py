"""The incremental detokenizer's stop strings and end of stream, and encoding and decoding off the
event loop, on the test checkpoints' byte-level tokenizer."""

import asyncio

import pytest

from controlplane.tokenizer import Tokenizer
from dataplane.checkpoints import build_tokenizer

TOKENIZER = Tokenizer(build_tokenizer(320), 320)


def feed(token_ids: list[int], stop: tuple[str, ...], min_tokens: int = 0) -> tuple[str, bool]:
    """What a client gets: the text released until a stop string is hit, else all of it."""
    detokenizer = TOKENIZER.detokenizer(stop)
    text = ""
    for n, token in enumerate(token_ids, start=1):
        delta, stopped = detokenizer.add(token, may_stop=n > min_tokens)
        text += delta
        if stopped:
            return text, True
    return text + detokenizer.flush(), False


def test_stop_strings_count_only_after_min_tokens():
    words = "ab cd ab ef ab"
    token_ids = TOKENIZER.encode(words)
    assert feed(token_ids, ("ab",)) == ("", True)
    # the first "ab" came before min_tokens: the next one stops the text
    first_ab = next(n for n in range(len(token_ids) + 1)
                    if "ab" in TOKENIZER.decode(token_ids[:n]))
    assert feed(token_ids, ("ab",), min_tokens=first_ab) == ("ab cd ", True)
    assert feed(token_ids, ("ab",), min_tokens=len(token_ids)) == (words, False)


def test_a_stop_string_that_starts_before_min_tokens_and_completes_after_it_counts():
    token_ids = TOKENIZER.encode("xy zw")
    # tokens up to the one that completes "xy z": "y z" starts before and ends after
    ends = next(n for n in range(len(token_ids) + 1)
                if TOKENIZER.decode(token_ids[:n]).startswith("xy z"))
    assert feed(token_ids, ("y z",), min_tokens=ends - 1) == ("x", True)


def test_the_end_of_stream_gives_an_unfinished_characters_bytes_as_a_whole_decode_does():
    token_ids = TOKENIZER.encode("é日")
    assert len(token_ids) > 2  # the tiny vocabulary spells them in bytes
    for n in range(1, len(token_ids) + 1):
        for stop in ((), ("never",)):
            assert feed(token_ids[:n], stop) == (TOKENIZER.decode(token_ids[:n]), False)


TEXT = "the quick brown fox jumps over the lazy dog " * 25_000  # 1.1 MB
IDS = [ord(c) for c in TEXT]


@pytest.mark.parametrize("off_loop, on_loop, data", [
    (TOKENIZER.encode_off_loop, TOKENIZER.encode, TEXT),
    (TOKENIZER.decode_off_loop, TOKENIZER.decode, IDS)], ids=["encode", "decode"])
def test_a_long_input_is_coded_while_the_event_loop_keeps_turning(off_loop, on_loop, data):
    async def run():
        coding = asyncio.create_task(off_loop(data))
        await asyncio.sleep(0)  # the task has started: on the loop, it would have finished
        assert not coding.done()
        return await coding

    assert asyncio.run(run()) == on_loop(data)
