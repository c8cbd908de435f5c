"""Host-side step math of dataplane.input_batch."""

import numpy as np
import pytest

from dataplane.input_batch import leading_ones


@pytest.mark.parametrize("counts,expected", [
    ([], 0), ([1, 1, 1], 3), ([5, 1, 1], 0), ([1, 1, 7, 1], 2), ([1, 0, 1], 1), ([2], 0)])
def test_leading_ones_counts_the_decodes_a_step_starts_with(counts, expected):
    assert leading_ones(np.array(counts, dtype=np.int32)) == expected
