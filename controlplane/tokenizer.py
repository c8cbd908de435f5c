"""The checkpoint's own tokenizer (tokenizer.json through the `tokenizers` library, no torch),
and the incremental detokenizer that turns a stream of token ids into text with stop strings."""

import pathlib

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, model_vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = model_vocab_size  # the model's, which may exceed the tokenizer's
        self._tokenizer_vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path, model_vocab_size: int) -> "Tokenizer":
        path = pathlib.Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: the control plane needs the checkpoint's "
                                    "tokenizer.json")
        return cls(_HFTokenizer.from_file(str(path)), model_vocab_size)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        known = [t for t in token_ids if t < self._tokenizer_vocab_size]
        return self._tokenizer.decode(known, skip_special_tokens=skip_special_tokens)

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
    stop string is only ever searched for in the held-back text plus the new text.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""

    def add(self, token_id: int) -> tuple[str, bool]:
        """Feed one token; returns (text to release now, whether a stop string was hit). After a
        hit, the text up to (not including) the stop string has been released."""
        if not self._stop:  # nothing to hold back
            return self._tokenizer.decode_step(self._stream, token_id), False
        self._pending += self._tokenizer.decode_step(self._stream, token_id)
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        if hits:
            text, self._pending = self._pending[:min(hits)], ""
            return text, True
        cut = max(len(self._pending) - self._hold, 0)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, False

    def flush(self) -> str:
        """The held-back text, once the request ends for a reason other than a stop string."""
        text, self._pending = self._pending, ""
        return text
