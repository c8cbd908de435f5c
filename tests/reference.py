"""Reference outputs from Hugging Face transformers."""

import functools
import pathlib

import torch


@functools.lru_cache(maxsize=4)
def _model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model_dir: pathlib.Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' model and its own KV cache, EOS ignored (the requests
    set ignore_eos)."""
    model = _model(str(model_dir))
    out_tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            out_tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[out_tokens[-1]]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return out_tokens


def hf_logprobs(model_dir: pathlib.Path, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position: [len(tokens), vocab]."""
    model = _model(str(model_dir))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
