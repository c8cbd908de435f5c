"""RunnerConfig's checks, and the KV block size the runner settles on: the one the attention
backend needs, else the one asked for, else the backend's preferred."""

import pytest

from dataplane.model_runner import ModelRunner, RunnerConfig


@pytest.mark.parametrize("field,value,message", [
    ("block_size", 24, "block_size must be a power of two, not 24"),
    ("block_size", 0, "block_size must be a power of two, not 0"),
    ("num_kv_blocks", 0, "num_kv_blocks must be >= 1, not 0"),
    ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be in \(0, 1\], not 1.5"),
    ("device", "tpu", "device must be cpu or cuda, not 'tpu'"),
])
def test_config_rejects(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        RunnerConfig(model_dir=tmp_path, **{field: value})


class _Needs128:
    """A backend that needs 128-token blocks (as flash_attn with FA4 does)."""
    name, block_size, preferred_block_size = "needs_128", 128, 128


class _Prefers128:
    """A backend that takes any size and is fastest on 128 (as triton_fa4 is)."""
    name, block_size, preferred_block_size = "prefers_128", None, 128


@pytest.mark.parametrize("backend,asked,expected", [
    ("torch", None, 16), ("torch", 4, 4),
    (_Prefers128, None, 128), (_Prefers128, 16, 16),
    (_Needs128, None, 128), (_Needs128, 16, 128),
])
def test_block_size_is_needed_else_asked_else_preferred(checkpoints, monkeypatch, backend, asked,
                                                        expected):
    if backend != "torch":
        monkeypatch.setattr("dataplane.model_runner.make_backend", lambda name, device: backend())
    runner = ModelRunner.load(RunnerConfig(model_dir=checkpoints["untied"], block_size=asked,
                                           num_kv_blocks=8))
    assert runner.block_size == expected


def test_a_block_size_the_backend_overrides_is_logged(checkpoints, monkeypatch, caplog):
    monkeypatch.setattr("dataplane.model_runner.make_backend", lambda name, device: _Needs128())
    with caplog.at_level("WARNING", logger="splitserve.dataplane"):
        ModelRunner.load(RunnerConfig(model_dir=checkpoints["untied"], block_size=16,
                                      num_kv_blocks=8))
    assert "attention backend needs_128 needs 128-token KV blocks: block_size 16 ignored" \
        in caplog.text
