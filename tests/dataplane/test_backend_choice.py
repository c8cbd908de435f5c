"""`--attention-backend auto` on a Hopper GPU (the capability faked here, on CPU): FA4 is
optional, so an install that fails to import, whatever it raises, leaves auto on triton and says
why in the log, while an explicit triton_fa4 raises."""

import logging
import sys

import pytest
import torch

from dataplane.attention import base


class BrokenFa4:
    """A meta-path finder that fails every flash_attn import with `error`, as an install whose
    native part does not load (a CUTLASS DSL built for another CUDA) raises from inside the
    import."""

    def __init__(self, error: Exception):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn" or name.startswith("flash_attn."):
            raise self.error
        return None


@pytest.fixture
def hopper_with(monkeypatch):
    """Install a finder that fails flash_attn's import with the given error, on a faked
    capability-9 GPU, with no flash_attn module already imported. FA4's disk-cache switch is
    set for the test (the import sets it in the environment otherwise) and restored after."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    for name in [n for n in sys.modules if n == "flash_attn" or n.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)

    def install(error: Exception) -> None:
        monkeypatch.setattr(sys, "meta_path", [BrokenFa4(error), *sys.meta_path])
    return install


@pytest.mark.parametrize("error", [RuntimeError("CUDA driver version is insufficient"),
                                   OSError("libcuda.so.1: cannot open shared object file")])
def test_auto_picks_triton_when_fa4_breaks_on_import(hopper_with, caplog, error):
    hopper_with(error)
    with caplog.at_level(logging.WARNING, logger="splitserve.dataplane"):
        assert base._best_gpu_backend() == "triton"
    assert f"FlashAttention-4 failed to import ({type(error).__name__}: {error})" in caplog.text


def test_auto_picks_triton_without_fa4_and_logs_why(hopper_with, caplog):
    hopper_with(ModuleNotFoundError("No module named 'quack'"))
    with caplog.at_level(logging.INFO, logger="splitserve.dataplane"):
        assert base._best_gpu_backend() == "triton"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "FlashAttention-4's forward does not import: No module named 'quack'")]


@pytest.mark.parametrize("error, raised, match", [
    (RuntimeError("CUDA driver version is insufficient"), RuntimeError, "driver version"),
    (ModuleNotFoundError("No module named 'flash_attn'"), ValueError,
     r"triton_fa4 needs FlashAttention-4 .* install the fa4 extra")])
def test_explicit_triton_fa4_raises(hopper_with, error, raised, match):
    hopper_with(error)
    with pytest.raises(raised, match=match):
        base.make_backend("triton_fa4", "cuda")
