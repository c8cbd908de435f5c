"""The checkpoint's own tokenizer (tokenizer.json through the `tokenizers` library, no torch),
and the incremental detokenizer that turns a stream of token ids into text with stop strings."""

import asyncio
import pathlib

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from common.errors import ConfigError


# Texts up to this long are encoded, and lists of ids this long decoded, on the event loop (a
# few milliseconds): a thread hop costs more than it saves there.
_INLINE_CHARS = 4096
_INLINE_IDS = 4096


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, model_vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = model_vocab_size  # the model's, which may exceed the tokenizer's
        self._tokenizer_vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path, model_vocab_size: int) -> "Tokenizer":
        path = pathlib.Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise ConfigError(f"{path} not found: the control plane needs the checkpoint's "
                              "tokenizer.json")
        return cls(_HFTokenizer.from_file(str(path)), model_vocab_size)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    async def encode_off_loop(self, text: str) -> list[int]:
        """encode() in a worker thread for a long text, so that the event loop (the engine's:
        its steps, the data-plane link's heartbeats) keeps running meanwhile. `encode_batch`
        lets go of the GIL while it works; `encode` holds it (2 MB of text: 1.5 s, past the
        link's heartbeat timeout)."""
        if len(text) <= _INLINE_CHARS:
            return self.encode(text)
        return await asyncio.to_thread(
            lambda: self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        known = [t for t in token_ids if t < self._tokenizer_vocab_size]
        return self._tokenizer.decode(known, skip_special_tokens=skip_special_tokens)

    async def decode_off_loop(self, token_ids: list[int]) -> str:
        """decode() in a worker thread for many ids, as encode_off_loop: 4M ids held the event
        loop for 2 s; `decode_batch` lets go of the GIL while it works."""
        if len(token_ids) <= _INLINE_IDS:
            return self.decode(token_ids)
        return await asyncio.to_thread(lambda: self._tokenizer.decode_batch(
            [[t for t in token_ids if t < self._tokenizer_vocab_size]],
            skip_special_tokens=True)[0])

    def decode_step(self, stream: DecodeStream, token_id: int) -> str:
        """The text one more token adds to `stream` ("" while a character is incomplete, and for
        ids the tokenizer does not know: the model's vocabulary may be padded)."""
        if token_id >= self._tokenizer_vocab_size:
            return ""
        return stream.step(self._tokenizer, token_id) or ""

    def detokenizer(self, stop: tuple[str, ...] = ()) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, stop)


class IncrementalDetokenizer:
    """Text deltas for one request's output tokens, holding back whatever could still become a
    stop string, so a stop string split over several tokens or chunks never reaches the client.

    Invariant: text already released cannot contain the start of a stop string that is still
    incomplete, because the last `max(len(stop)) - 1` characters are always held back; so a
    stop string is only ever searched for in the held-back text plus the new text, and only
    matches that end in the new text count (an earlier one was found when it completed, or came
    before min_tokens, when stop strings do not count yet: see `add`).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        # tokens fed since the stream last gave text: the bytes of a character not yet complete
        self._undecoded: list[int] = []

    def _decode_step(self, token_id: int) -> str:
        text = self._tokenizer.decode_step(self._stream, token_id)
        if text:
            self._undecoded.clear()
        else:
            self._undecoded.append(token_id)
        return text

    def add(self, token_id: int, may_stop: bool = True) -> tuple[str, bool]:
        """Feed one token; returns (text to release now, whether a stop string was hit). After a
        hit, the text up to (not including) the stop string has been released. may_stop=False
        (before min_tokens, as in vLLM) looks for no stop string, but still holds text back: one
        that starts there and completes later counts."""
        if not self._stop:  # nothing to hold back
            return self._decode_step(token_id), False
        start = len(self._pending)
        self._pending += self._decode_step(token_id)
        if may_stop:
            hits = [i for i in (self._pending.find(s, max(start - len(s) + 1, 0))
                                for s in self._stop) if i >= 0]
            if hits:
                text, self._pending = self._pending[:min(hits)], ""
                return text, True
        cut = max(len(self._pending) - self._hold, 0)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, False

    def flush(self) -> str:
        """The held-back text, once the request ends for a reason other than a stop string, and
        the bytes of a last character never completed, as the replacement character(s) a whole
        decode of the output (Detokenize) gives for them."""
        tail = self._tokenizer.decode(self._undecoded) if self._undecoded else ""
        text, self._pending, self._undecoded = self._pending + tail, "", []
        return text
