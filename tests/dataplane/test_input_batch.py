"""Host-side step math: dataplane.input_batch and the ForwardContext it builds."""

import numpy as np
import pytest
import torch

from dataplane.forward_context import ForwardContext
from dataplane.input_batch import leading_ones


@pytest.mark.parametrize("counts,expected", [
    ([], 0), ([1, 1, 1], 3), ([5, 1, 1], 0), ([1, 1, 7, 1], 2), ([1, 0, 1], 1), ([2], 0)])
def test_leading_ones_counts_the_decodes_a_step_starts_with(counts, expected):
    assert leading_ones(np.array(counts, dtype=np.int32)) == expected


def test_the_decodes_longest_context_ignores_the_prompts_after_them():
    def context(seq_lens: list[int], num_decodes: int) -> ForwardContext:
        empty = torch.zeros(0)
        return ForwardContext(query_start_loc=empty, seq_lens=empty, slot_mapping=empty,
                              block_tables=empty, logits_indices=empty, max_query_len=2,
                              max_seq_len=max(seq_lens), query_start_loc_host=None,
                              seq_lens_host=seq_lens, num_decodes=num_decodes)
    assert context([5, 90, 3, 4000], 3).max_decode_seq_len == 90
    assert context([5, 90, 3, 4000], 0).max_decode_seq_len == 0
