"""Launch sizes on the host, without Triton's wrappers (no kernel here).

`triton.next_power_of_2` and `triton.cdiv` are constexpr functions in Triton 3.6: called from
Python, each took ~2 us to unwrap its arguments on this project's CPU host, against ~0.06 us for
the plain integer expression. The launchers of eagerly run steps call them on every launch: a
prompt step's attention launchers four times a layer, ~0.25 ms of the ~5 ms of host time such a
step takes on the H200's host (bench/results/h200/host-timers-6f1e38d.log).
"""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 0 (0 for 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
