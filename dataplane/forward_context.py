"""The one sanctioned global: attention metadata of the forward pass in flight.

Set only with `forward_context(...)`, which restores the previous value; read only by the
attention layers and the LM head; reading it outside a forward pass raises.
"""

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Callable, Iterator

import torch


@dataclass
class ForwardContext:
    """One batch of requests, each with `query_lens[i]` new tokens after `context_lens[i]` cached.

    Tensors live on the model's device; `*_host` lists mirror them for backends that loop on the
    host (the torch reference backend). Captured CUDA graphs have no host lists (None): only
    backends that read nothing back on the host run inside them.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32: cached + new tokens after this step
    slot_mapping: torch.Tensor  # [num_tokens] int64: KV-cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the hidden state to project
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: list[int] | None
    seq_lens_host: list[int] | None
    # What the attention backend derives from the batch once a forward and every layer reads
    # (the Triton backend's launches and its decode kernel's tile list). The first attention
    # layer clears it, so each forward rebuilds it, inside a CUDA graph's capture too.
    attention_plan: object | None = None
    # Set only while MixedGraphs captures a step's pieces: the attention layers hand it their
    # queries instead of attending (attention runs eagerly between the pieces' replays) and
    # continue with what it returns. (layer, q [T, heads, head_dim]) -> out [T, heads, head_dim]
    split_at_attention: Callable[[object, torch.Tensor], torch.Tensor] | None = None
    # With split_at_attention: the buffer the layers write their queries into, the one the
    # runner attends from between the pieces (no copy of a step's queries a layer).
    split_queries: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def num_decodes(self) -> int:
        """The leading requests with one new token each (decodes come first in a step: the
        scheduler serves running requests first): a backend may attend for them with its decode
        kernel and for the rest with its prefill kernel. From the host offsets, once a step and
        only when read (eager steps); 0 without them (a captured graph)."""
        starts = self.query_start_loc_host or [0]
        num = 0
        while num + 1 < len(starts) and starts[num + 1] == num + 1:
            num += 1
        return num


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: attention and the LM head run only inside forward_context()")
    return _current
