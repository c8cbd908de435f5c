from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters after validation, with every default resolved."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
