"""The launchers' host-side size helpers, against their definitions and (where Triton is
installed) against the Triton functions they replace."""

import importlib.util

import pytest

from dataplane.kernels.sizes import cdiv, next_power_of_2


def test_next_power_of_2_is_the_smallest_power_of_two_not_below():
    assert next_power_of_2(0) == 0
    for n in range(1, 5000):
        p = next_power_of_2(n)
        assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


def test_cdiv_rounds_up():
    assert [cdiv(a, 16) for a in (0, 1, 15, 16, 17, 32)] == [0, 1, 1, 1, 2, 2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_they_equal_tritons():
    import triton
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        assert cdiv(n, 64) == triton.cdiv(n, 64)
