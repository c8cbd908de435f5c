"""Vocab-parallel embedding and LM head: each rank holds ceil(vocab / tp) rows; the last shard is
zero-padded so any vocabulary size splits over any number of ranks."""

import torch
import torch.nn.functional as F
from torch import nn

from dataplane.distributed import all_reduce, gather_to_rank0, tp_rank, tp_size
from dataplane.forward_context import get_forward_context


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        param.data.zero_()
        if size:
            param.data[:size].copy_(loaded[self.vocab_start:self.vocab_start + size])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local * in_shard, self.weight)  # [num_tokens, hidden]
        return all_reduce(out * in_shard.unsqueeze(1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the rows the forward context asks for, full vocabulary, on rank 0 only."""
        hidden = hidden[get_forward_context().logits_indices]  # [num_logits, hidden]
        logits = gather_to_rank0(F.linear(hidden, self.weight))  # [num_logits, tp * shard]
        return logits[:, :self.vocab_size] if logits is not None else None
