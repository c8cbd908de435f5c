"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 with a sparse MoE block as the MLP.

Attention, norms, embeddings and the layers' forward are Qwen3's. A layer is sparse unless it is
listed in `mlp_only_layers` or falls between `decoder_sparse_step`s; dense layers keep Qwen3's MLP
of `intermediate_size` (Qwen3's layers, given the MLP per layer). Configs written by transformers 4.x (`num_experts`, `rope_theta`) and 5.x
(`num_local_experts`, `rope_parameters`) read alike through transformers' Qwen3MoeConfig, whose
`num_experts` names either.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from dataplane.layers.fused_moe import FusedMoE, expert_weight_route
from dataplane.layers.linear import ReplicatedLinear
from dataplane.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """transformers' rule (Qwen3MoeDecoderLayer)."""
    return (layer_id not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))  # router logits: [T, num_experts]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, layer_mlp=lambda i: (Qwen3MoeSparseMoeBlock(config)
                                                      if is_sparse_layer(config, i) else None))

    def checkpoint_route(self, name: str) -> tuple[str, tuple] | None:
        """The loader's hook for tensors that are not one-to-one with a parameter: the experts'
        (per expert, or already stacked) go into the stacked `w13` / `w2` of their layer."""
        return expert_weight_route(name)
