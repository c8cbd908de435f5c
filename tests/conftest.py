import pathlib

import pytest

try:
    import torch
except ImportError:  # the control-plane-only install
    torch = None


def pytest_collection_modifyitems(config, items):
    has_cuda = torch is not None and torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Small seeded random Qwen3 checkpoints written by transformers, by name."""
    from dataplane.checkpoints import TinyQwen3, write_random_qwen3
    root = tmp_path_factory.mktemp("checkpoints")
    specs = {
        "untied": (TinyQwen3(), {}),
        "tied": (TinyQwen3(tie_word_embeddings=True, num_hidden_layers=3), {"seed": 1}),
        # vocab not divisible by 2 (TP pads the last shard) and larger than the tokenizer's
        "odd_vocab": (TinyQwen3(vocab_size=321), {"seed": 2, "tokenizer_vocab_size": 300}),
    }
    return {name: write_random_qwen3(root / name, spec, **kwargs)
            for name, (spec, kwargs) in specs.items()}


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Small seeded random Qwen3-MoE checkpoints (8 experts, top-2) written by transformers."""
    from dataplane.checkpoints import TinyQwen3Moe, write_random_qwen3_moe
    root = tmp_path_factory.mktemp("moe_checkpoints")
    specs = {
        # layer 1 dense (mlp_only_layers), top-k weights renormalized; one tensor per expert (hub)
        "moe": (TinyQwen3Moe(mlp_only_layers=(1,)), {}),
        # every second layer sparse (decoder_sparse_step), raw softmax weights, tied embeddings;
        # experts stacked as transformers 5 holds them
        "moe_step2": (TinyQwen3Moe(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False,
                                   tie_word_embeddings=True), {"seed": 1, "stacked_experts": True}),
    }
    return {name: write_random_qwen3_moe(root / name, spec, **kwargs)
            for name, (spec, kwargs) in specs.items()}
