"""The model `splitserve serve` uses when none is given: a small Qwen3 with seeded random
weights (it produces gibberish), written once to a cache directory."""

import os
import pathlib
import subprocess
import sys

from common.errors import ConfigError

DEFAULT_MODEL_NAME = "tiny-random-qwen3-v1"


def cache_dir() -> pathlib.Path:
    """The one place the cache location is read from the environment."""
    if "SPLITSERVE_CACHE" in os.environ:
        return pathlib.Path(os.environ["SPLITSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return pathlib.Path(base) / "splitserve"


def ensure_default_model(path: pathlib.Path | None = None) -> pathlib.Path:
    """The default model's directory (under the cache unless `path` is given), written if absent."""
    path = path or cache_dir() / "models" / DEFAULT_MODEL_NAME
    if not (path / "config.json").exists():
        # Written by a child process: the control plane's process never imports torch.
        subprocess.run([sys.executable, "-m", "dataplane.checkpoints", str(path)], check=True)
        if not (path / "config.json").exists():  # (the writer took a failed rename for a race)
            raise ConfigError(f"{path} is in the way of the default model: a file, or a "
                              "directory that is not empty")
    return path
