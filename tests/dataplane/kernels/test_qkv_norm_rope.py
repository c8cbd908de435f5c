"""qkv_proj with Qwen3's attention prologue in its epilogue against torch's GEMM and the
prologue's reference, and against the two launches it replaces; where the model takes it."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.checkpoints import DEFAULT_MODEL, QWEN3_0_6B, TinyQwen3  # noqa: E402
from dataplane.kernels.decode_matmul import MAX_ROWS_PLAIN, decode_matmul  # noqa: E402
from dataplane.kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from dataplane.kernels.qkv_norm_rope import (  # noqa: E402
    qkv_norm_rope, qkv_norm_rope_pays, qkv_norm_rope_ref)
from dataplane.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, gemm_operands, randn, skip_unsupported)

pytestmark = KERNEL_MARKS
EPS = 1e-6


def operands(num_rows, num_heads, num_kv_heads, head_dim, hidden, block_size, dtype, device,
             gen):
    """x, w, then the prologue's arguments: positions, norm weights, eps, the cos/sin cache, a
    NaN-poisoned K/V cache [2, num_blocks, block_size, kv_heads, head_dim] and slots (every
    fourth -1: a padding row)."""
    x, w = gemm_operands(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, hidden, dtype,
                         device, gen)
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(device)
    positions = torch.randint(0, 4096, (num_rows,), generator=gen).to(device)
    norms = [randn(head_dim, dtype=dtype, device=device, gen=gen) for _ in range(2)]
    num_blocks = -(-2 * num_rows // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_rows]
    slots[::4] = -1
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                    dtype=dtype, device=device)
    return x, w, (positions, *norms, EPS, rope.cos_sin_cache), kv, slots.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 7, 64, 100])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,hidden", [
    (16, 8, 128, 1024),  # Qwen3-0.6B
    (8, 4, 32, 128),  # the default model
    (4, 2, 64, 256),
])
@pytest.mark.parametrize("block_size", [1, 16])
def test_qkv_norm_rope_against_the_gemm_and_the_prologue(dtype, num_rows, num_heads,
                                                        num_kv_heads, head_dim, hidden,
                                                        block_size, device, gen):
    """q normalized and rotated; the normalized, rotated k and the projected v at their slots,
    every other slot (and the padding rows') still NaN."""
    skip_unsupported(dtype, device)
    x, w, prologue, kv, slots = operands(num_rows, num_heads, num_kv_heads, head_dim, hidden,
                                         block_size, dtype, device, gen)
    expected_kv = kv.clone()
    expected_q = qkv_norm_rope_ref(x, w, num_heads, num_kv_heads, *prologue, expected_kv[0],
                                   expected_kv[1], slots)
    q = qkv_norm_rope(x, w, num_heads, num_kv_heads, *prologue, kv[0], kv[1], slots)
    assert q.shape == (num_rows, num_heads, head_dim) and q.is_contiguous()
    assert_close(q, expected_q, dtype)
    assert torch.equal(kv.isnan(), expected_kv.isnan())
    assert (~kv.isnan()).sum() == 2 * (slots >= 0).sum() * num_kv_heads * head_dim
    assert_close(kv.nan_to_num(), expected_kv.nan_to_num(), dtype)


@pytest.mark.parametrize("num_rows", [3, 40])
def test_qkv_norm_rope_equals_the_two_launches_it_replaces(num_rows, device, gen):
    """Strided input rows, q into a given buffer: what decode_matmul then qk_norm_rope_store
    give (the same dots in the same order, the same rounding)."""
    dtype = torch.float32
    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 32, 128
    x, w, prologue, kv, slots = operands(num_rows, num_heads, num_kv_heads, head_dim, hidden, 16,
                                         dtype, device, gen)
    wide = torch.cat([x, x[:, :16]], dim=1)
    x = wide[:, :hidden]
    expected_kv = kv.clone()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = decode_matmul(x, w)
    expected_q = qk_norm_rope_store(
        prologue[0], qkv[:, :q_size].view(-1, num_heads, head_dim),
        qkv[:, q_size:q_size + kv_size].view(-1, num_kv_heads, head_dim),
        qkv[:, q_size + kv_size:].view(-1, num_kv_heads, head_dim), *prologue[1:],
        expected_kv[0], expected_kv[1], slots)
    q_out = torch.full_like(expected_q, float("nan"))
    assert qkv_norm_rope(x, w, num_heads, num_kv_heads, *prologue, kv[0], kv[1], slots,
                         q_out=q_out) is q_out
    assert_close(q_out, expected_q, dtype)
    assert torch.equal(kv.isnan(), expected_kv.isnan())
    assert_close(kv.nan_to_num(), expected_kv.nan_to_num(), dtype)


def heads(c: TinyQwen3) -> tuple[int, int, int, int]:
    return c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size


def test_where_the_model_takes_it():
    """Qwen3-0.6B up to MAX_ROWS_PLAIN rows in bf16; the default model and the GPU tests'
    `wide_heads` checkpoint (tests/conftest.py) in float32 too, so the tests against transformers
    run it; head_dim 16 (the tiny checkpoints) makes no dot tile and keeps the two launches."""
    assert qkv_norm_rope_pays(1, *heads(QWEN3_0_6B), torch.bfloat16)
    assert qkv_norm_rope_pays(MAX_ROWS_PLAIN, *heads(QWEN3_0_6B), torch.bfloat16)
    assert not qkv_norm_rope_pays(MAX_ROWS_PLAIN + 1, *heads(QWEN3_0_6B), torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        assert qkv_norm_rope_pays(8, *heads(DEFAULT_MODEL), dtype)
    assert qkv_norm_rope_pays(8, *heads(TinyQwen3(head_dim=32)), torch.float32)
    assert not qkv_norm_rope_pays(8, *heads(TinyQwen3()), torch.float32)
