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


class _PlanRecorder:
    """An attention backend that notes the plan each layer finds and leaves one behind."""

    name = "recorder"
    block_size = None

    def __init__(self) -> None:
        self.seen: list[object | None] = []

    def forward(self, q, k_cache, v_cache, ctx, scale):
        self.seen.append(ctx.attention_plan)
        if ctx.attention_plan is None:
            ctx.attention_plan = object()
        return q


def test_the_first_attention_layer_makes_every_forward_rebuild_the_plan():
    """A CUDA graph's warm-up and capture run the same context: the capture must build the plan
    again (inside the graph), not reuse the warm-up's."""
    from dataplane.forward_context import forward_context
    from dataplane.layers.attention import Attention
    backend = _PlanRecorder()
    layers = [Attention(2, 1, 4, 0.5) for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), backend,
                            is_first_layer=i == 0)
    ctx = ForwardContext(query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([1]),
                         slot_mapping=torch.tensor([0]), block_tables=torch.zeros(1, 1),
                         logits_indices=torch.tensor([0]), max_query_len=1, max_seq_len=1,
                         query_start_loc_host=[0, 1], seq_lens_host=[1])
    q, kv = torch.zeros(1, 2, 4), torch.zeros(1, 1, 4)
    with forward_context(ctx):
        for _ in range(2):  # two forwards of one context
            for layer in layers:
                layer(q, kv, kv)
    first, second = backend.seen[:3], backend.seen[3:]
    assert first[0] is None and first[1] is first[2] is not None
    assert second[0] is None and second[1] is second[2] is not first[1]
