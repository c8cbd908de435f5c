"""`--attention-backend auto` on a Hopper GPU (the capability faked here, on CPU): FA4 is
optional, so an install that fails to import, whatever it raises, leaves auto on triton and says
why in the log, while an explicit triton_fa4 raises. The same when FA4 imports but fails in its
first compile at configure (on a GPU in test_gpu_runner; here the runner's control flow, with
FA4's failure and the triton backend stood in for)."""

import logging
import sys
import weakref
from dataclasses import replace

import pytest
import torch

from dataplane import model_runner
from dataplane.attention import base
from dataplane.attention.flash_attn_backend import Fa4Error
from dataplane.attention.torch_backend import TorchAttention
from dataplane.model_runner import ModelRunner, RunnerConfig
from dataplane.worker import EpochState, Liveness, _configure
from protos import link_pb2
from tests.dataplane.steps import configure


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


class StandIn(TorchAttention):
    """The torch backend under another name: triton_fa4's and triton's places on CPU."""

    def __init__(self, name: str, preferred_block_size: int = 16):
        self.name, self.preferred_block_size = name, preferred_block_size


@pytest.fixture
def fa4_runner(checkpoints, monkeypatch):
    """A CPU runner whose backend is a stand-in triton_fa4 on 128-token blocks, whose configure
    fails as FA4's compile in the warm-up would, once the KV cache is allocated and bound, and
    whose make_backend gives stand-ins; takes the --attention-backend it was asked for and the
    TP size, and gives the runner and weak references to its failed attempts' caches."""
    real_configure = ModelRunner._configure
    failed_caches = []

    def configure_or_fail(self, limits):
        num_blocks = real_configure(self, limits)
        if self.backend.name == "triton_fa4":
            failed_caches.append(weakref.ref(self.kv))
            raise Fa4Error("DSLRuntimeError: no kernel image for this GPU")
        return num_blocks
    monkeypatch.setattr(ModelRunner, "_configure", configure_or_fail)
    monkeypatch.setattr(model_runner, "make_backend", lambda name, device: StandIn(name))

    def make(asked: str, tp_size: int = 1) -> tuple[ModelRunner, list[weakref.ref]]:
        monkeypatch.setattr(model_runner, "tp_size", lambda: tp_size)
        config = RunnerConfig(model_dir=checkpoints["untied"], attention_backend="torch")
        runner = ModelRunner.load(config)
        runner.config = replace(config, attention_backend=asked)
        runner.backend, runner.block_size = StandIn("triton_fa4", 128), 128
        return runner, failed_caches
    return make


def test_auto_falls_back_to_triton_when_fa4_fails_at_configure(fa4_runner, caplog):
    """On the block size the Hello announced, every layer on the new backend and cache (the
    failed attempt's freed before the new one is sized), and the Ready names the backend."""
    runner, failed_caches = fa4_runner("auto")
    message = link_pb2.LinkMessage(epoch=1, configure=configure())
    with caplog.at_level(logging.WARNING, logger="splitserve.dataplane"):
        ready = _configure(runner, message, EpochState(), Liveness(None)).ready
    assert (runner.backend.name, runner.block_size) == ("triton", 128)
    assert (ready.attention_backend, ready.block_size) == ("triton", 128)
    assert ready.num_kv_blocks > 0 and runner.kv.shape[3] == 128
    layers = runner.model.attention_layers()
    assert all(layer.backend is runner.backend for layer in layers)
    assert all(layer.k_cache.data_ptr() == runner.kv[0, i].data_ptr()
               for i, layer in enumerate(layers))
    assert [cache() for cache in failed_caches] == [None]
    assert "FlashAttention-4 failed at configure (DSLRuntimeError: no kernel image for this " \
           "GPU): attention backend auto falls back to triton on 128-token KV blocks" in caplog.text


@pytest.mark.parametrize("asked, tp_size", [("triton_fa4", 1), ("auto", 2)])
def test_explicit_triton_fa4_or_tp_raises_when_fa4_fails_at_configure(fa4_runner, asked,
                                                                       tp_size):
    """TP > 1 under auto too: a rank that fell back alone would leave the others waiting."""
    runner, _ = fa4_runner(asked, tp_size)
    with pytest.raises(Fa4Error, match="no kernel image"):
        runner.configure(configure())
    assert runner.backend.name == "triton_fa4"
