"""How long a step may run before the data plane counts as stuck (a hung collective, a frozen
rank): a multiple of what recent steps took, scaled by the step's size, within [floor, cap].

Dead or frozen rank-0 processes are caught sooner by heartbeats; this catches a rank 0 that still
heartbeats from its I/O thread while its main thread waits forever on another rank.
"""

from collections import deque


class StepDeadline:
    def __init__(self, floor_s: float = 2.0, factor: float = 8.0, cap_s: float = 120.0,
                 window: int = 64, warmup_steps: int = 3) -> None:
        assert 0 < floor_s <= cap_s and factor >= 1
        self.floor_s = floor_s
        self.factor = factor
        self.cap_s = cap_s
        self.warmup_steps = warmup_steps
        self._history: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)

    def reset(self) -> None:
        """A new data plane: its speed is unknown until it has run a few steps."""
        self._history.clear()

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._history.append((max(num_tokens, 1), seconds))

    def timeout_for(self, num_tokens: int) -> float:
        if len(self._history) < self.warmup_steps:
            return self.cap_s
        slowest_step = max(seconds for _, seconds in self._history)
        slowest_per_token = max(seconds / tokens for tokens, seconds in self._history)
        predicted = max(slowest_step, slowest_per_token * max(num_tokens, 1))
        return min(self.cap_s, self.floor_s + self.factor * predicted)
