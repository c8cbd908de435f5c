"""Qwen3 dense, built from tensor-parallel layers.

Per rank: q/k/v and gate/up are column-parallel (heads and the intermediate size split over the
ranks), o_proj and down_proj row-parallel (one all-reduce each); the hidden state is replicated.
On one GPU, at 1-128 rows and hidden sizes up to 1024 (Qwen3-0.6B), o_proj and down_proj hand
the norm after them float32 split-K partial sums instead (RowParallelLinear's feeds_norm).
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from dataplane.distributed import tp_size
from dataplane.layers.attention import Attention
from dataplane.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from dataplane.layers.layernorm import RMSNorm
from dataplane.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from dataplane.layers.rotary import RotaryEmbedding


def rope_theta(config: PretrainedConfig) -> float:
    """transformers 5 moved rope_theta into rope_parameters; 4.x configs have it at the top."""
    parameters = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or parameters
    assert scaling.get("rope_type", scaling.get("type", "default")) == "default", (
        f"rope scaling {scaling} is not supported")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads // tp_size()
        self.num_kv_heads = config.num_key_value_heads // tp_size()
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          bias=getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=False, feeds_norm=True)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          rope_theta(config))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        if q.is_cuda:  # one kernel for the norms, RoPE and the K/V store
            out = self.attn.forward_qk_norm_rope(positions, q, k, v, self.q_norm, self.k_norm,
                                                 self.rotary_emb.cos_sin_cache)
        else:
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
            out = self.attn(q, k, v)  # [T, heads, head_dim]
        return self.o_proj(out.flatten(1))  # [T, hidden], or split-K partials [splits, T, hidden]


class Qwen3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, feeds_norm=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))  # [T, intermediate / tp] between


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.mlp = mlp if mlp is not None else Qwen3MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# Builds the MLP of layer i, or None for the dense one (Qwen3-MoE's sparse layers).
LayerMLP = Callable[[int], nn.Module | None]


class Qwen3Model(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_mlp: LayerMLP | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, layer_mlp(i) if layer_mlp else None)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(token_ids), None  # [T, hidden]
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (our parameter name, shard id) for projections we store fused
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, layer_mlp: LayerMLP | None = None) -> None:
        super().__init__()
        self.model = Qwen3Model(config, layer_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(token_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
