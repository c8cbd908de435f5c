"""End to end through the model runner: a tiny random Qwen3 gives the same logits (and the same
greedy tokens) with the Triton or FlashAttention backend as with the torch reference backend,
over prefill, chunked prefill mixed with decodes, a prefix-cache hit, and decode steps.

On CPU this runs under TRITON_INTERPRET=1 in float32 (attention kernels only: the layers use
their torch code on CPU); on a GPU in float32 and bfloat16, with the fused layer kernels, and
the decode steps replay the runner's CUDA graphs (the torch backend runs eagerly).
"""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from tests.dataplane.kernels.helpers import KERNEL_MARKS, counted  # noqa: E402
from tests.dataplane.steps import Sched, configure, make_step  # noqa: E402

pytestmark = KERNEL_MARKS

# float32: the kernels differ from SDPA only in summation order (logits of magnitude ~5).
# bfloat16: each run rounds every activation (~0.1 off the float32 logits here); the backend must
# stay within twice the torch backend's own bf16 error, measured against a float32 run. A wrong
# mask or a missed token moves logits by O(1).
FP32_ATOL = 1e-3
BF16_SLACK = 0.05


def blocks(first: int, num_tokens: int, block_size: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // block_size)))


def steps(vocab: int, block_size: int) -> list:
    """Steps with the tokens fixed in advance (each runner decodes the same sequence)."""
    g = torch.Generator().manual_seed(0)
    len_a = 2 * block_size + 8
    a, b, c = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (len_a, 3, 9))
    first = blocks(0, len_a + 8, block_size)  # room for the decodes
    return [
        make_step(1, [Sched(0, 0, block_size + 1, first, new_tokens=a),  # a's first chunk
                      Sched(1, 0, 3, blocks(60, 3 + 8, block_size), new_tokens=b)]),
        make_step(2, [Sched(0, block_size + 1, len_a - block_size - 1, []),  # rest of a
                      Sched(1, 3, 1, [])]),  # a decode in the same batch
        # c after a's first block: a prefix-cache hit, the block shared with request 0
        make_step(3, [Sched(2, block_size, 9, [first[0]] + blocks(90, 9, block_size),
                            new_tokens=a[:block_size] + c)]),
        *[make_step(4 + i, [Sched(0, len_a + i, 1, []), Sched(1, 4 + i, 1, [])])
          for i in range(4)],
    ]


def run(model_dir, device: str, dtype: str, backend: str, block_size: int) -> list[torch.Tensor]:
    runner = ModelRunner.load(RunnerConfig(model_dir=model_dir, device=device, dtype=dtype,
                                           attention_backend=backend, block_size=block_size,
                                           num_kv_blocks=128))
    runner.configure(configure(max_model_len=1024))
    outputs = []
    for step in steps(runner.vocab_size, block_size):
        logits, inputs = runner.forward(step)
        if inputs is not None and len(inputs.sampled_slots):
            runner.batch.append_sampled(inputs, torch.zeros(len(inputs.sampled_slots),
                                                            dtype=torch.int64, device=logits.device))
            outputs.append(logits.float().cpu())
    return outputs


def backends_and_devices() -> list:
    cases = [pytest.param("triton", "cpu", "float32", 4, id="triton-cpu-fp32")]
    cases += [pytest.param("triton", "cuda", dt, 16, id=f"triton-cuda-{dt}")
              for dt in ("float32", "bfloat16")]
    cases += [pytest.param("flash_attn", "cuda", "bfloat16", None, id="flash_attn-cuda-bf16")]
    cases += [pytest.param("triton_fa4", "cuda", "bfloat16", bs, id=f"triton_fa4-cuda-bf16-bs{bs}")
              for bs in (128, 16)]  # FA4's TMA pages and its cp.async gather
    return cases


def count_fa4_calls(monkeypatch, calls: list) -> None:
    """triton_fa4 with every step's prompt rows through FA4 (these steps bring 9-136 of them,
    short prompts it leaves to our kernel when serving), each call noted in `calls`; skips
    without FA4."""
    from dataplane.attention import flash_attn_backend
    forward_into = flash_attn_backend.fa4_forward_into()
    if forward_into is None:
        pytest.skip("no FlashAttention-4 (flash_attn.cute)")
    monkeypatch.setattr(flash_attn_backend, "fa4_forward_into",
                        lambda: counted(forward_into, calls))
    monkeypatch.setattr("dataplane.attention.base.FA4_MIN_PREFILL_ROWS", 0)
    monkeypatch.setattr("dataplane.attention.flash_attn_backend.FA4_MAX_ONE_TILE_ROWS", 0)


@pytest.mark.parametrize("backend,device,dtype,block_size", backends_and_devices())
def test_logits_match_the_torch_backend(checkpoints, backend, device, dtype, block_size,
                                        monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU case runs under the interpreter only")
    if backend == "flash_attn":
        from dataplane.attention.flash_attn_backend import import_flash_attn
        fa, errors = import_flash_attn()
        if fa is None:
            pytest.skip(f"no FlashAttention: {'; '.join(errors)}")
        block_size = fa.block_size
    fa4_calls = []
    if backend == "triton_fa4":
        count_fa4_calls(monkeypatch, fa4_calls)
    path = checkpoints["untied"]
    expected = run(path, device, dtype, "torch", block_size)
    actual = run(path, device, dtype, backend, block_size)
    assert bool(fa4_calls) == (backend == "triton_fa4"), "FA4 ran where it should not, or not"
    assert len(actual) == len(expected) == 7
    if dtype == "float32":
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        return
    truth = run(path, device, "float32", "torch", block_size)
    for got, want, true in zip(actual, expected, truth):
        error, reference_error = (got - true).abs().max(), (want - true).abs().max()
        assert error <= 2 * reference_error + BF16_SLACK, (error, reference_error)
