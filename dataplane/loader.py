"""Build a model on its device and fill it from a Hugging Face safetensors directory.

Each parameter's `weight_loader` reads only this rank's part of each checkpoint tensor through a
safetensors slice, so a rank never holds a full copy of a sharded weight.
"""

import pathlib

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from dataplane.models import model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(model_dir: str | pathlib.Path) -> PretrainedConfig:
    return AutoConfig.from_pretrained(str(model_dir))


def resolve_dtype(name: str, config: PretrainedConfig) -> torch.dtype:
    """`auto` takes the checkpoint's dtype (transformers 5 calls it `dtype`, 4.x `torch_dtype`)."""
    if name == "auto":
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
        name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (choose from: auto, {', '.join(DTYPES)})")
    return DTYPES[name]


LOAD_FORMATS = ("safetensors", "dummy")


def load_model(model_dir: str | pathlib.Path, config: PretrainedConfig, dtype: torch.dtype,
               device: torch.device, load_format: str = "safetensors") -> nn.Module:
    """`dummy` fills the weights with random values instead of reading them (benchmarks: speed
    does not depend on the values, and no checkpoint of that size needs to exist)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r}: choose from {', '.join(LOAD_FORMATS)}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)(config)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        fill_random(model)
    else:
        load_weights(model, pathlib.Path(model_dir))
    return model.eval()


@torch.no_grad()
def fill_random(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Uniform weights of that std (norms around 1), like transformers' init, on the device."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    half_width = std * 3 ** 0.5
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-half_width, half_width, generator=generator)


def load_weights(model: nn.Module, model_dir: pathlib.Path) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = _load_one(model, params, name, f.get_slice(name))
                if target is not None:
                    loaded.add(target)
    missing = {n for n, p in model.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {sorted(missing)[:8]}")
    for name, module in model.named_modules():  # layers that fill a parameter from many tensors
        lacking = module.missing_weights() if hasattr(module, "missing_weights") else []
        if lacking:
            raise ValueError(f"checkpoint {model_dir} lacks weights for {name}: {lacking[:8]}")


def _load_one(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor) -> str | None:
    """Route one checkpoint tensor to its parameter; returns the parameter's name.

    A model may define `checkpoint_route(name) -> (parameter name, weight_loader args) | None`
    for tensors that fill part of a parameter other than by `packed_modules_mapping` (MoE
    experts stacked into one tensor); it is asked first."""
    route = getattr(model, "checkpoint_route", None)
    routed = route(name) if route is not None else None
    if routed is not None:
        target, loader_args = routed
        params[target].weight_loader(params[target], tensor, *loader_args)
        return target
    for checkpoint_part, (fused_part, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{checkpoint_part}." in name:
            target = name.replace(f".{checkpoint_part}.", f".{fused_part}.")
            param = params[target]
            param.weight_loader(param, tensor, shard_id)
            return target
    if name not in params:
        if name == "lm_head.weight":  # tied embeddings stored twice: the embedding already has it
            return None
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter")
    param = params[name]
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(tensor[:])
    else:
        loader(param, tensor)
    return name
