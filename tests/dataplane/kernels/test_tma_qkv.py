"""qkv_proj with the attention prologue in its epilogue (kernels/tma_qkv.py) against cuBLAS then
qk_norm_rope_store_ref, and Qwen3's attention taking it in prompt steps."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.tma_matmul import PREFILL_GROUPED_ABOVE, PREFILL_MIN_ROWS  # noqa: E402
from dataplane.kernels.tma_qkv import (  # noqa: E402
    tma_qkv_norm_rope_store, tma_qkv_norm_rope_store_ref, tma_qkv_pays)
from dataplane.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    KERNEL_MARKS, assert_close, nan_like, on_gpu, randn, skip_unsupported)

pytestmark = KERNEL_MARKS
EPS = 1e-6
SMALL = dict(BLOCK_M=64, BLOCK_K=64, num_stages=2, num_warps=4, HEADS_PER_PROGRAM=1)  # quick under the interpreter


def prologue_case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, k: int,
                  block_size: int, dtype: torch.dtype, device: torch.device,
                  gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    """(x, w, num_heads, positions, q_weight, k_weight, eps, cos_sin_cache) and a NaN-poisoned
    cache [2, num_blocks, block_size, num_kv_heads, head_dim], every fourth slot -1 (padding)."""
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x = randn(num_tokens, k, dtype=dtype, device=device, gen=gen)
    w = randn(n, k, dtype=dtype, device=device, gen=gen, scale=k ** -0.5)
    q_weight = randn(head_dim, dtype=dtype, device=device, gen=gen)
    k_weight = randn(head_dim, dtype=dtype, device=device, gen=gen)
    num_blocks = -(-2 * num_tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                    dtype=dtype, device=device)
    return (x, w, num_heads, positions, q_weight, k_weight, EPS, rope.cos_sin_cache), \
        slots.to(device), kv


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 130])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,k", [(4, 2, 32, 128),
                                                               (3, 1, 64, 64),
                                                               (16, 8, 128, 1024)])
@pytest.mark.parametrize("group_m", [0, 2])
@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_tma_qkv_writes_q_and_k_v_at_their_slots(dtype, num_tokens, num_heads, num_kv_heads,
                                                 head_dim, k, group_m, heads_per_program,
                                                 device, gen):
    """q normalized and rotated into a new tensor; the normalized, rotated k and the projected v
    at their slots (padding rows, slot -1, write nothing; every other slot keeps its NaN
    poison); 130 rows: the last 64-row tile runs past the tokens. Two heads a program where
    the head counts are even."""
    skip_unsupported(dtype, device)
    if num_kv_heads % heads_per_program:
        pytest.skip("two heads a program: even head counts only")
    if device.type == "cpu" and k * num_heads > 2048 and num_tokens > 7:
        pytest.skip("the interpreter is slow: Qwen3-0.6B's shape at 1 and 7 rows only")
    args, slots, kv = prologue_case(num_tokens, num_heads, num_kv_heads, head_dim, k, 16,
                                    dtype, device, gen)
    expected_kv = kv.clone()
    expected_q = tma_qkv_norm_rope_store_ref(*args, expected_kv[0], expected_kv[1], slots)
    q = tma_qkv_norm_rope_store(*args, kv[0], kv[1], slots, config=SMALL | dict(GROUP_M=group_m, HEADS_PER_PROGRAM=heads_per_program))
    assert q.shape == (num_tokens, num_heads, head_dim) and q.is_contiguous()
    assert_close(q, expected_q, dtype)
    assert torch.equal(kv.isnan(), expected_kv.isnan())
    assert (~kv.isnan()).sum() == 2 * (slots >= 0).sum() * num_kv_heads * head_dim
    assert_close(kv.nan_to_num(), expected_kv.nan_to_num(), dtype)


def test_tma_qkv_into_a_given_buffer_from_strided_rows(device, gen):
    """Rows that are a slice of a wider tensor; q written into `q_out` and nothing past its rows;
    no rows: no launch."""
    dtype = torch.float16
    args, slots, kv = prologue_case(70, 4, 2, 32, 128, 4, dtype, device, gen)
    wide = randn(70, 128 + 64, dtype=dtype, device=device, gen=gen)
    args = (wide[:, :128], *args[1:])
    buffer = nan_like(torch.empty(80, 4, 32, dtype=dtype, device=device))
    expected_kv = kv.clone()
    expected_q = tma_qkv_norm_rope_store_ref(*args, expected_kv[0], expected_kv[1], slots)
    q = tma_qkv_norm_rope_store(*args, kv[0], kv[1], slots, q_out=buffer[:70], config=SMALL)
    assert q.data_ptr() == buffer.data_ptr()
    assert_close(q, expected_q, dtype)
    assert buffer[70:].isnan().all()
    assert_close(kv.nan_to_num(), expected_kv.nan_to_num(), dtype)
    x, w, num_heads, positions, *weights_eps_rope = args
    empty = tma_qkv_norm_rope_store(x[:0], w, num_heads, positions[:0], *weights_eps_rope,
                                    kv[0], kv[1], slots[:0])
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("num_rows", [PREFILL_MIN_ROWS - 1, PREFILL_MIN_ROWS + 100,
                                      PREFILL_GROUPED_ABOVE + 1])
def test_tma_qkv_in_bf16_at_prompt_rows(num_rows, device, gen):
    """Qwen3-0.6B's shapes with the shipped tiles (grouped above PREFILL_GROUPED_ABOVE rows);
    tma_qkv_pays from PREFILL_MIN_ROWS rows."""
    if not on_gpu(device) or torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("the TMA GEMM runs on CUDA devices of compute capability 9 and later")
    dtype = torch.bfloat16
    args, slots, kv = prologue_case(num_rows, 16, 8, 128, 1024, 16, dtype, device, gen)
    assert tma_qkv_pays(args[0], args[1], 16, 8, 128) == (num_rows >= PREFILL_MIN_ROWS)
    expected_kv = kv.clone()
    expected_q = tma_qkv_norm_rope_store_ref(*args, expected_kv[0], expected_kv[1], slots)
    q = tma_qkv_norm_rope_store(*args, kv[0], kv[1], slots)
    assert_close(q, expected_q, dtype)
    assert_close(kv.nan_to_num(), expected_kv.nan_to_num(), dtype)


def prompt_step_logits(model_dir, dtype: str, enforce_eager: bool) -> torch.Tensor:
    """The last logits of two 1,050-token prompts in one step (2,100 rows, from
    PREFILL_MIN_ROWS; in the 4,096-row piecewise graph unless eager), then of a decode step."""
    from dataplane.model_runner import ModelRunner, RunnerConfig
    from tests.dataplane.steps import Sched, configure, make_step
    runner = ModelRunner.load(RunnerConfig(model_dir=model_dir, device="cuda", dtype=dtype,
                                           num_kv_blocks=160, block_size=16,
                                           enforce_eager=enforce_eager))
    runner.configure(configure(max_num_seqs=4, max_model_len=2048, max_num_batched_tokens=4096))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, runner.vocab_size, (1050,), generator=g).tolist()
               for _ in range(2)]
    logits = []
    for step in (make_step(1, [Sched(i, 0, 1050, list(range(70 * i, 70 * i + 70)),
                                     new_tokens=p) for i, p in enumerate(prompts)]),
                 make_step(2, [Sched(i, 1050, 1) for i in range(2)])):
        step_logits, inputs = runner.forward(step)
        runner.batch.append_sampled(inputs, step_logits.argmax(-1))
        logits.append(step_logits.float().cpu())
    runner.release()
    return torch.cat(logits)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_default_model_prompt_steps_with_the_fused_prologue(enforce_eager, monkeypatch,
                                                            tmp_path, device):
    """The default model (head_dim 32) in bf16 through the runner: a 2,100-token prompt step
    takes the fused launch in every layer (eagerly and in the piecewise graph), and its logits
    and the next step's (which read the k and v it stored) stay as near float32's as those of
    the same steps without it."""
    if not on_gpu(device) or torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("the TMA GEMM runs on CUDA devices of compute capability 9 and later")
    from dataplane.checkpoints import write_default_model
    from dataplane.kernels import tma_qkv
    write_default_model(tmp_path)
    truth = prompt_step_logits(tmp_path, "float32", enforce_eager=True)
    monkeypatch.setattr(tma_qkv, "tma_qkv_pays", lambda *args: False)
    unfused = prompt_step_logits(tmp_path, "bfloat16", enforce_eager)
    monkeypatch.undo()
    launches = []
    monkeypatch.setattr(tma_qkv, "tma_qkv_norm_rope_store", lambda *args, **kwargs: (
        launches.append(args[0].shape[0]) or tma_qkv_norm_rope_store(*args, **kwargs)))
    fused = prompt_step_logits(tmp_path, "bfloat16", enforce_eager)
    assert launches and min(launches) >= PREFILL_MIN_ROWS
    error, reference_error = (fused - truth).abs().max(), (unfused - truth).abs().max()
    assert error <= 2 * reference_error + 0.05, (error, reference_error)
