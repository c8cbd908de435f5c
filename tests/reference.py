"""Reference outputs from Hugging Face transformers."""

import functools
import pathlib

import torch


@functools.lru_cache(maxsize=4)
def _model(path: str):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model_dir: pathlib.Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' model, EOS ignored (the requests set ignore_eos): the
    argmax of a full forward pass per token, no KV cache involved."""
    model = _model(str(model_dir))
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def hf_logprobs(model_dir: pathlib.Path, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position: [len(tokens), vocab]."""
    model = _model(str(model_dir))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
