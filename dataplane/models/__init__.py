"""Model definitions by Hugging Face architecture name."""

from torch import nn
from transformers import PretrainedConfig


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    architecture = (config.architectures or ["?"])[0]
    if architecture == "Qwen3ForCausalLM":
        from dataplane.models.qwen3 import Qwen3ForCausalLM
        return Qwen3ForCausalLM
    raise ValueError(f"unsupported architecture {architecture!r} (supported: Qwen3ForCausalLM)")
