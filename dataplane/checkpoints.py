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


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """N(0, init_std) weights and 1 + N(0, 0.1) norm weights, seeded."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
        else:
            param.copy_(init_std * torch.randn(param.shape, generator=generator))


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
    model = Qwen3ForCausalLM(hf_config(spec))
    _randomize(model, seed, init_std)
    model.to(dtype).save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, min(tokenizer_vocab_size or spec.vocab_size, spec.vocab_size))
    return path


# Real shapes, for benchmarks with random weights (`--load-format dummy`).
QWEN3_0_6B = TinyQwen3(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                       rope_theta=1000000.0)
QWEN3_8B = TinyQwen3(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False,
                     rope_theta=1000000.0)


def write_config_only(path: str | pathlib.Path, config, dtype: torch.dtype = torch.bfloat16,
                      tokenizer_vocab_size: int = 1024) -> pathlib.Path:
    """A model directory without weights (config, generation config, tokenizer): enough for
    `--load-format dummy`, at any size."""
    from transformers import GenerationConfig

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(str(path))
    GenerationConfig(eos_token_id=config.eos_token_id).save_pretrained(str(path))
    write_tokenizer(path, min(tokenizer_vocab_size, config.vocab_size))
    return path


def write_default_model(path: pathlib.Path) -> None:
    """Write DEFAULT_MODEL to `path` atomically (a half-written directory is never seen)."""
    import os
    import tempfile
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from planes running as other users
    write_random_qwen3(tmp, DEFAULT_MODEL, seed=0, init_std=0.05)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race; keep its copy
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import sys
    write_default_model(pathlib.Path(sys.argv[1]))


@dataclass(frozen=True)
class TinyQwen3Moe(TinyQwen3):
    """A small Qwen3-MoE. Layers are sparse unless listed in mlp_only_layers or off the
    decoder_sparse_step; dense layers use intermediate_size."""
    intermediate_size: int = 96
    num_hidden_layers: int = 3
    moe_intermediate_size: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()


def hf_moe_config(spec: TinyQwen3Moe):
    from transformers import Qwen3MoeConfig
    fields = asdict(spec) | {"mlp_only_layers": list(spec.mlp_only_layers)}
    return Qwen3MoeConfig(**fields, bos_token_id=None, eos_token_id=0, pad_token_id=0,
                          architectures=["Qwen3MoeForCausalLM"])


def write_random_qwen3_moe(path: str | pathlib.Path, spec: TinyQwen3Moe = TinyQwen3Moe(),
                           seed: int = 0, init_std: float = 0.2,
                           dtype: torch.dtype = torch.float32,
                           tokenizer_vocab_size: int | None = None,
                           stacked_experts: bool = False) -> pathlib.Path:
    """`write_random_qwen3` for Qwen3-MoE (same seeded init, router included).

    Experts are written as on the hub, one tensor per expert and projection
    (`mlp.experts.{e}.gate_proj.weight`), which is what transformers' `save_pretrained` writes by
    default; `stacked_experts` writes transformers 5's in-memory layout instead
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
    """
    from safetensors import safe_open
    from transformers import Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = Qwen3MoeForCausalLM(hf_moe_config(spec))
    _randomize(model, seed, init_std)
    model.to(dtype).save_pretrained(str(path), safe_serialization=True,
                                    save_original_format=not stacked_experts)
    names = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    marker = ".experts.gate_up_proj" if stacked_experts else ".experts.0.gate_proj.weight"
    assert any(name.endswith(marker) for name in names), f"no *{marker} in {sorted(names)[:8]}"
    write_tokenizer(path, min(tokenizer_vocab_size or spec.vocab_size, spec.vocab_size))
    return path


# Benchmark shapes (random weights): Qwen3-30B-A3B's config.
QWEN3_30B_A3B = TinyQwen3Moe(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                             head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0)


def _hub_tensors(name: str, shape: torch.Size) -> list[tuple[str, tuple[int, ...]]]:
    """transformers 5's stacked expert parameters -> the hub's per-expert tensors (name, shape);
    other parameters as they are."""
    prefix, _, proj = name.rpartition(".")
    if not prefix.endswith(".experts"):
        return [(name, tuple(shape))]
    num_experts, rows, cols = shape
    if proj == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", (rows, cols)) for e in range(num_experts)]
    return [(f"{prefix}.{e}.{half}.weight", (rows // 2, cols))
            for e in range(num_experts) for half in ("gate_proj", "up_proj")]


def write_large_random_qwen3_moe(path: str | pathlib.Path, spec: TinyQwen3Moe = QWEN3_30B_A3B,
                                 seed: int = 0, init_std: float = 0.02,
                                 dtype: torch.dtype = torch.bfloat16,
                                 shard_bytes: int = 4 << 30) -> pathlib.Path:
    """Random weights at real sizes for benchmarks, in the hub's layout (per-expert tensors,
    safetensors shards of ~shard_bytes and their index), generated tensor by tensor on all cores:
    the model is never held (`write_random_qwen3_moe` builds transformers' model in float32,
    120 GB for Qwen3-30B-A3B). Uniform values of the same std as the small writers' normal ones."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_moe_config(spec)
    with torch.device("meta"):
        names_shapes = [(n, p.shape) for n, p in Qwen3MoeForCausalLM(config).named_parameters()]
    hub = [tensor for name, shape in names_shapes for tensor in _hub_tensors(name, shape)]

    def generate(tensor_id: int) -> torch.Tensor:  # seeded by its index: machine-independent
        name, shape = hub[tensor_id]
        mean, std = (1.0, 0.1) if name.endswith("norm.weight") else (0.0, init_std)
        return _uniform(shape, mean, std, dtype, seed=(seed << 24) + tensor_id)

    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    with ThreadPoolExecutor() as pool:  # uniform_ releases the GIL; 64 tensors in flight at most
        for window in range(0, len(hub), 64):
            ids = range(window, min(window + 64, len(hub)))
            for tensor_id, tensor in zip(ids, pool.map(generate, ids)):
                shard[hub[tensor_id][0]] = tensor
                if len(shard) % 64 == 0 and sum(t.nbytes for t in shard.values()) >= shard_bytes:
                    _save_shard(path, shard, weight_map, save_file)
    _save_shard(path, shard, weight_map, save_file)
    total_size = sum(torch.Size(shape).numel() for _, shape in names_shapes) * dtype.itemsize
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map}))
    config.dtype = dtype
    config.save_pretrained(str(path))
    write_tokenizer(path, min(1024, spec.vocab_size))
    return path


def _uniform(shape: tuple[int, ...], mean: float, std: float, dtype: torch.dtype,
             seed: int) -> torch.Tensor:
    """Uniform values of that mean and std: several times faster than randn at these sizes."""
    half_width = std * 3 ** 0.5
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=dtype).uniform_(mean - half_width, mean + half_width,
                                                    generator=generator)


def _save_shard(path: pathlib.Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str],
                save_file) -> None:
    if shard:
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()
