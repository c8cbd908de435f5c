"""What ForwardContext derives from a step's host lists."""

import pytest
import torch

from dataplane.forward_context import ForwardContext
from tests.dataplane.kernels.helpers import cumsum0


def context(query_lens: list[int], seq_lens: list[int] | None = None,
            host: bool = True) -> ForwardContext:
    empty = torch.zeros(0)
    seq_lens = seq_lens if seq_lens is not None else [q + 10 for q in query_lens]
    return ForwardContext(query_start_loc=empty, seq_lens=empty, slot_mapping=empty,
                          block_tables=empty, logits_indices=empty,
                          max_query_len=max(query_lens, default=0),
                          max_seq_len=max(seq_lens, default=0),
                          query_start_loc_host=cumsum0(query_lens) if host else None,
                          seq_lens_host=seq_lens if host else None)


@pytest.mark.parametrize("query_lens,expected", [
    ([], 0), ([1, 1, 1], 3), ([5, 1, 1], 0), ([1, 1, 7, 1], 2), ([1, 0, 1], 1), ([2], 0),
    ([1, 0, 2], 1)])
def test_num_decodes_counts_the_one_token_requests_a_step_starts_with(query_lens, expected):
    assert context(query_lens).num_decodes == expected


def test_a_captured_graph_has_no_host_lists_and_counts_no_decodes():
    assert context([1, 1], host=False).num_decodes == 0


def test_the_decodes_longest_context_ignores_the_prompts_after_them():
    assert context([1, 1, 1, 30], [5, 90, 3, 4000]).max_decode_seq_len == 90
    assert context([30, 1], [4000, 90]).max_decode_seq_len == 0
