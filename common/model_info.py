"""What both planes read from a Hugging Face checkpoint directory without torch: config.json and
generation_config.json as plain JSON."""

import hashlib
import json
import pathlib
from dataclasses import dataclass

from common.errors import ConfigError


@dataclass(frozen=True)
class ModelInfo:
    name: str
    fingerprint: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: str

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> "ModelInfo":
        path = pathlib.Path(model_dir)
        try:
            raw = (path / "config.json").read_bytes()
            config = json.loads(raw)
            if not isinstance(config, dict):
                raise ValueError("config.json holds no JSON object")
            architectures = config.get("architectures") or ["unknown"]
            return cls(
                name=path.resolve().name,
                fingerprint=hashlib.sha256(raw).hexdigest(),
                architecture=architectures[0],
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                eos_token_ids=_eos_token_ids(path, config),
                dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            )
        except (FileNotFoundError, NotADirectoryError, PermissionError, ValueError,
                KeyError) as e:  # (json.JSONDecodeError is a ValueError)
            raise ConfigError(f"{path} is not a Hugging Face checkpoint directory: "
                              f"{type(e).__name__}: {e}") from e


def _eos_token_ids(path: pathlib.Path, config: dict) -> tuple[int, ...]:
    """generation_config.json wins over config.json, as in transformers' generate()."""
    eos = config.get("eos_token_id")
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
