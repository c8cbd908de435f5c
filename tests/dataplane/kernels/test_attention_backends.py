"""The Triton and FlashAttention backends against the torch reference backend: the same
attention output over the same cache (which the Triton and torch stores fill alike), on
decode-only and mixed batches."""

import dataclasses
import math

import pytest
import torch

triton = pytest.importorskip("triton")

from dataplane.attention import make_backend  # noqa: E402
from dataplane.attention.flash_attn_backend import (  # noqa: E402
    Fa4PagedPrefill, fa4_forward_into, import_flash_attn)
from dataplane.attention.torch_backend import TorchAttention  # noqa: E402
from dataplane.attention.torch_backend import store_kv as torch_store_kv  # noqa: E402
from dataplane.attention.triton_backend import TritonAttention, TritonFa4Attention  # noqa: E402
from dataplane.forward_context import ForwardContext  # noqa: E402
from dataplane.kernels.paged_inputs import DIRECT_LAUNCH_TRITON_VERSIONS  # noqa: E402
from dataplane.kernels.store_kv import store_kv  # noqa: E402
from tests.dataplane.kernels.helpers import (  # noqa: E402
    DTYPES, KERNEL_MARKS, assert_close, counted, cumsum0, on_gpu, randn, skip_unsupported)

pytestmark = KERNEL_MARKS

# (new tokens, cached tokens) per request
DECODE = [(1, 0), (1, 16), (1, 99), (1, 300), (1, 15)]
MIXED = [(1, 40), (37, 0), (1, 1), (16, 112), (5, 3), (130, 0), (1, 700)]
# decodes first, as the scheduler orders a step: the Triton backend sends the first three to its
# decode kernel (at an odd offset into the step's arrays) and the rest to its prefill kernel
DECODES_FIRST = [(1, 40), (1, 700), (1, 0), (37, 0), (16, 112), (1, 5), (130, 0)]


def make_context(lens: list[tuple[int, int]], block_size: int, device: torch.device,
                 gen: torch.Generator) -> tuple[ForwardContext, int]:
    """Shuffled blocks for each request, slots for its new tokens; returns (ctx, num_blocks)."""
    query_lens = [q for q, _ in lens]
    seq_lens = [q + c for q, c in lens]
    blocks_per_req = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(blocks_per_req) + 1, dtype=torch.int32)
    slots = []
    for i, (seq_len, count) in enumerate(zip(seq_lens, blocks_per_req)):
        ids = order[:count]
        order = order[count:]
        tables[i, :count] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(seq_len - query_lens[i], seq_len):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
    starts = cumsum0(query_lens)
    ctx = ForwardContext(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        logits_indices=torch.tensor(starts[1:], device=device) - 1,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=seq_lens)
    return ctx, num_blocks


def compare_with_torch(backend, lens, dtype, block_size, device, gen,
                       num_heads=16, num_kv_heads=8, head_dim=128, num_layers=2):
    """Run both backends on identical caches ([2, layers, ...] like the runner's, layer 1 used)."""
    ctx, num_blocks = make_context(lens, block_size, device, gen)
    num_tokens = ctx.slot_mapping.shape[0]
    kv = randn(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
               device=device, gen=gen)
    kv_ref = kv.clone()
    q = randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device, gen=gen)
    qkv = randn(num_tokens, 2 * num_kv_heads * head_dim, dtype=dtype, device=device, gen=gen)
    k, v = qkv.view(num_tokens, 2, num_kv_heads, head_dim).unbind(1)  # strided views
    scale = head_dim ** -0.5
    store_kv(k, v, kv[0, 1], kv[1, 1], ctx.slot_mapping)  # the layer's store on CUDA
    torch_store_kv(k, v, kv_ref[0, 1], kv_ref[1, 1], ctx.slot_mapping)  # and elsewhere
    assert torch.equal(kv, kv_ref), "the stores differ"
    out = backend.forward(q, kv[0, 1], kv[1, 1], ctx, scale)
    expected = TorchAttention().forward(q, kv_ref[0, 1], kv_ref[1, 1], ctx, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("lens", [DECODE, MIXED, DECODES_FIRST],
                         ids=["decode", "mixed", "decodes_first"])
def test_triton_backend_matches_torch(dtype, block_size, lens, device, gen):
    skip_unsupported(dtype, device)
    compare_with_torch(TritonAttention(), lens, dtype, block_size, device, gen)


@pytest.mark.parametrize("num_programs", [1, 3])
def test_triton_backend_with_fixed_programs(num_programs, device, gen):
    compare_with_torch(TritonAttention(num_programs=num_programs), DECODE, torch.float32, 16,
                       device, gen, num_heads=32, num_kv_heads=8)


@pytest.mark.parametrize("shared_buffers", [True, False], ids=["graph_pieces", "eager"])
@pytest.mark.parametrize("lens", [DECODE, DECODES_FIRST], ids=["decode", "decodes_first"])
def test_triton_backend_layers_share_the_steps_launches(shared_buffers, lens, device, gen):
    """The first layer of a forward prepares the step's launches and the next layers run them on
    their own caches: from the same q/out buffers (between a prompt step's graph pieces) or from
    new ones a layer (eager). A layer whose q is laid out otherwise fails loudly."""
    num_layers, num_heads, num_kv_heads, head_dim, block_size = 3, 16, 8, 32, 4
    ctx, num_blocks = make_context(lens, block_size, device, gen)
    num_tokens = ctx.slot_mapping.shape[0]
    kv = randn(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
               dtype=torch.float32, device=device, gen=gen)
    backend, scale = TritonAttention(), head_dim ** -0.5
    q_buffer = randn(num_tokens, num_heads, head_dim, dtype=torch.float32, device=device, gen=gen)
    out_buffer = torch.empty_like(q_buffer)
    ctx.attention_plan = None  # what the model's first attention layer does
    for layer in range(num_layers):
        if shared_buffers:
            q_buffer.copy_(randn(*q_buffer.shape, dtype=torch.float32, device=device, gen=gen))
            q, out = q_buffer, backend.forward(q_buffer, kv[0, layer], kv[1, layer], ctx, scale,
                                               out=out_buffer)
        else:
            q = randn(*q_buffer.shape, dtype=torch.float32, device=device, gen=gen)
            out = backend.forward(q, kv[0, layer], kv[1, layer], ctx, scale)
        expected = TorchAttention().forward(q, kv[0, layer], kv[1, layer], ctx, scale)
        assert_close(out, expected, torch.float32)
    step = ctx.attention_plan
    assert step is not None
    if device.type == "cuda" and triton.__version__.startswith(DIRECT_LAUNCH_TRITON_VERSIONS):
        # the layers after the first took the compiled kernels' own launch: on the H200 it
        # took ~2 ms off a small prompt step's host time (bench/README.md, twenty-fifth session)
        assert all(launch.launches_directly for launch in (step.decode, step.prefill)
                   if launch is not None)
    with pytest.raises(AssertionError, match="differs from the one the launch was prepared for"):
        backend.forward(q_buffer[:, :8], kv[0, 0][..., :4, :], kv[1, 0][..., :4, :], ctx, scale)


def test_direct_launches_hand_the_kernels_what_tritons_launch_does(device, gen):
    """After a step's first launch its compiled kernels are launched directly (PagedLaunch): with
    every argument after q, k_cache, v_cache and out as Triton's own binder orders and completes
    them (its JITFunction.run hands the compiled kernel those values)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    num_heads, num_kv_heads, head_dim, block_size = 16, 8, 32, 4
    ctx, num_blocks = make_context(DECODES_FIRST, block_size, device, gen)
    kv = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
               device=device, gen=gen)
    q = randn(ctx.slot_mapping.shape[0], num_heads, head_dim, dtype=torch.float32, device=device,
              gen=gen)
    TritonAttention().forward(q, kv[0], kv[1], ctx, head_dim ** -0.5)
    step = ctx.attention_plan
    for launch, q_part, out_part in [(step.decode, step.q_parts[0], step.out_parts[0]),
                                     (step.prefill, step.q_parts[1], step.out_parts[1])]:
        jit = launch.kernel if isinstance(launch.kernel, JITFunction) else JITFunction(
            launch.kernel.fn)  # under the interpreter: the kernel as Triton compiles it
        tensors = (q_part, kv[0], kv[1], out_part)
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        params, _, _ = binder(*tensors, *launch.rest, **launch.constexprs)
        expected = list(params.values())[len(tensors):]
        got = dataclasses.replace(launch, kernel=jit)._tail(tensors)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert a is b or (not isinstance(a, torch.Tensor) and a == b)


def test_make_backend_names(device):
    assert isinstance(make_backend("triton", device.type), TritonAttention)
    assert make_backend("auto", "cpu").name == "torch"
    assert make_backend("triton", device.type).block_size is None
    # the block sizes where --block-size is left out (serve's help and the README quote them)
    assert (TritonAttention.preferred_block_size, TritonFa4Attention.preferred_block_size) \
        == (16, 128)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("nope", device.type)
    if fa4_forward_into() is None:
        with pytest.raises(ValueError, match="triton_fa4 needs FlashAttention-4"):
            make_backend("triton_fa4", device.type)
    else:
        assert make_backend("triton_fa4", device.type).block_size is None
    if device.type == "cuda":  # FA4's prefill where it imports on Hopper, the only GPUs measured
        hopper_fa4 = torch.cuda.get_device_capability()[0] == 9 and fa4_forward_into() is not None
        assert make_backend("auto", "cuda").name == ("triton_fa4" if hopper_fa4 else "triton")


def test_triton_fa4_routes_only_large_prompt_parts_to_fa4(device, gen):
    """The prompt rows after the leading decodes go to FA4 with offsets, lengths and block
    tables of their own (a stand-in for FA4 records them and writes the torch reference);
    below fa4_min_rows our prefill kernel takes them, and in float32, which FA4 asserts on (a
    float32 model on triton_fa4 would fail at its first step of 4,096 prompt rows), and where
    every prompt fits one FA4 tile of rows (128 queries x 2 heads a KV head: FA4 would compile
    a kernel configure did not)."""
    calls = []

    def forward_into(q, k_cache, v_cache, out, **kwargs):
        calls.append(kwargs)
        starts = kwargs["cu_seqlens_q"].tolist()
        seq_lens = kwargs["seqused_k"]
        ctx = ForwardContext(
            query_start_loc=kwargs["cu_seqlens_q"], seq_lens=seq_lens,
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=q.device),
            block_tables=kwargs["page_table"], logits_indices=torch.zeros(0, device=q.device),
            max_query_len=kwargs["max_seqlen_q"], max_seq_len=kwargs["max_seqlen_k"],
            query_start_loc_host=starts, seq_lens_host=seq_lens.tolist())
        out[:starts[-1]] = TorchAttention().forward(q[:starts[-1]], k_cache, v_cache, ctx,
                                                    kwargs["softmax_scale"])

    num_prompt_rows = sum(q for q, _ in DECODES_FIRST[3:])  # 184, after three decodes
    short = DECODES_FIRST[:-1] + [(128, 0)]  # the longest prompt 128 tokens, not 130
    for lens, dtype, min_rows, used in [(DECODES_FIRST, torch.float16, num_prompt_rows, True),
                                        (DECODES_FIRST, torch.float16, num_prompt_rows + 1, False),
                                        (DECODES_FIRST, torch.float32, num_prompt_rows, False),
                                        (short, torch.float16, 0, False)]:
        calls.clear()
        backend = TritonFa4Attention(forward_into, min_rows)
        assert (backend.name, backend.block_size) == ("triton_fa4", None)
        compare_with_torch(backend, lens, dtype, 128, device, gen)  # 16 heads, 8 KV heads
        assert len(calls) == used
    ctx, _ = make_context(DECODES_FIRST, 128, device, gen)
    launch = TritonFa4Attention(forward_into, 0)._prepare_prefill(
        torch.zeros(0, 16, 128, dtype=torch.bfloat16), torch.zeros(1, 128, 8, 128), None, None,
        ctx, 0.5, 3)
    assert isinstance(launch, Fa4PagedPrefill)
    assert launch.cu_seqlens_q.tolist() == [0, 37, 53, 54, 184]
    assert launch.seqused_k.tolist() == [37, 128, 6, 130]
    assert torch.equal(launch.page_table, ctx.block_tables[3:])


@pytest.fixture(scope="module")
def flash_attn():
    if not torch.cuda.is_available():
        pytest.skip("FlashAttention needs a GPU")
    backend, errors = import_flash_attn()
    if backend is None:
        pytest.skip(f"no FlashAttention: {'; '.join(errors)}")
    return backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [DECODE, MIXED, DECODES_FIRST],
                         ids=["decode", "mixed", "decodes_first"])
@pytest.mark.parametrize("num_heads", [16, 32])
def test_flash_attn_backend_matches_torch(flash_attn, dtype, lens, num_heads, gen):
    device = torch.device("cuda")
    assert on_gpu(device)
    compare_with_torch(flash_attn, lens, dtype, flash_attn.block_size, device, gen,
                       num_heads=num_heads)


@pytest.fixture(scope="module")
def fa4_forward():
    if not torch.cuda.is_available():
        pytest.skip("FlashAttention-4 needs a GPU")
    forward_into = fa4_forward_into()
    if forward_into is None:
        pytest.skip("no FlashAttention-4 (flash_attn.cute)")
    return forward_into


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [MIXED, DECODES_FIRST], ids=["mixed", "decodes_first"])
@pytest.mark.parametrize("num_heads", [16, 32])
@pytest.mark.parametrize("block_size", [128, 16], ids=["tma_pages", "cp_async_pages"])
def test_triton_fa4_backend_matches_torch(fa4_forward, dtype, lens, num_heads, block_size, gen):
    """Our decode kernel for the leading one-token requests, FA4 (fa4_forward_into, writing
    into our buffer) for the rest: on Hopper its TMA path at 128-token blocks, its cp.async
    gather at 16."""
    calls = []
    backend = TritonFa4Attention(counted(fa4_forward, calls), 0)
    compare_with_torch(backend, lens, dtype, block_size, torch.device("cuda"), gen,
                       num_heads=num_heads)
    assert calls, "FA4 did not run"
