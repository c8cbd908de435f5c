"""Model definitions by Hugging Face architecture name."""

from torch import nn
from transformers import PretrainedConfig


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    architecture = (config.architectures or ["?"])[0]
    if architecture == "Qwen3ForCausalLM":
        from dataplane.models.qwen3 import Qwen3ForCausalLM
        return Qwen3ForCausalLM
    if architecture == "Qwen3MoeForCausalLM":
        from dataplane.models.qwen3_moe import Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM
    raise ValueError(f"unsupported architecture {architecture!r} "
                     "(supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM)")
