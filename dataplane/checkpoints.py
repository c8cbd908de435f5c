"""Small seeded random Qwen3 checkpoints, written in Hugging Face's own format by transformers.

Used by the tests (nothing downloads weights) and as `splitserve serve`'s default model. The
tokenizer is a byte-level BPE trained on a fixed text, so any string round-trips.
"""

import json
import pathlib
from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A split server keeps its decisions on the CPU and its
tensors on the GPU. Every step, the control plane sends the batch: token ids, positions, slot
mappings and block tables. The data plane answers with sampled tokens. Paged attention stores keys
and values in fixed-size blocks; a block table maps each request's positions to its blocks. When
memory runs out, the scheduler preempts the newest request and recomputes it later. The prefix
cache shares blocks whose tokens are equal, found by a chained hash of each full block.
Once upon a time, in a land far away, there lived a small model that knew only random words.
It counted one, two, three, four, five, six, seven, eight, nine, ten, and then it began again.
"""


@dataclass(frozen=True)
class TinyQwen3:
    vocab_size: int = 320
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


# `splitserve serve` with no --model: small enough to load in a second on a laptop CPU.
DEFAULT_MODEL = TinyQwen3(vocab_size=512, hidden_size=128, intermediate_size=384,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                          head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True)


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    return tokenizer


def write_tokenizer(path: pathlib.Path, vocab_size: int) -> None:
    """tokenizer.json plus the files transformers' AutoTokenizer looks for."""
    build_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": None, "pad_token": "<|endoftext|>", "model_max_length": 1 << 20}))


def hf_config(spec: TinyQwen3):
    from transformers import Qwen3Config
    return Qwen3Config(**asdict(spec), bos_token_id=None, eos_token_id=0, pad_token_id=0,
                       architectures=["Qwen3ForCausalLM"])


def write_random_qwen3(path: str | pathlib.Path, spec: TinyQwen3 = TinyQwen3(), seed: int = 0,
                       init_std: float = 0.2, dtype: torch.dtype = torch.float32,
                       tokenizer_vocab_size: int | None = None) -> pathlib.Path:
    """Write a seeded random checkpoint with transformers' `save_pretrained` (safetensors).

    Weights are N(0, init_std) and norm weights 1 + N(0, 0.1), larger than transformers' default
    init so that greedy choices are far from ties and comparisons are meaningful.
    """
    from transformers import Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3ForCausalLM(hf_config(spec))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(init_std * torch.randn(param.shape, generator=generator))
    model.to(dtype).save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, min(tokenizer_vocab_size or spec.vocab_size, spec.vocab_size))
    return path


def write_default_model(path: pathlib.Path) -> None:
    """Write DEFAULT_MODEL to `path` atomically (a half-written directory is never seen)."""
    import os
    import tempfile
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    write_random_qwen3(tmp, DEFAULT_MODEL, seed=0, init_std=0.05)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race; keep its copy
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import sys
    write_default_model(pathlib.Path(sys.argv[1]))
