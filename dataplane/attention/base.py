import logging
from typing import Protocol

import torch

from dataplane.forward_context import ForwardContext

BACKENDS = ("auto", "torch", "triton", "triton_fa4", "flash_attn")
# triton_fa4 hands FA4 the prompt rows of steps that bring at least this many, fewer to our
# prefill kernel. On an H100 (bench/results/h100/prefill_fa4-4ca2e63.json, workload A's prompts
# in steps of 2k-16k tokens) FA4's device time was below ours at every size (0.6B heads: 0.026
# against 0.042 ms at 2,048 rows, 0.048 against 0.079 at 4,096, 0.165 against 0.206 at 16k),
# but each call of its public function held the host ~155-175 us (ours, launched as prepared
# once a forward, ~20 us: bench/README's host-timers; triton_fa4 calls a private one). A
# prompt step launches attention between graph pieces, so FA4 pays once a 0.6B layer's device
# work outlasts that: ~0.32 ms a layer at 4,096 rows (a 16k-token step takes ~36 ms), ~0.16 at
# 2,048, where the step would wait on the host. Larger models' layers would pay from fewer rows.
# (`--attention-backend`'s help and the README quote this value.)
FA4_MIN_PREFILL_ROWS = 4096
log = logging.getLogger("splitserve.dataplane")


class AttentionBackend(Protocol):
    name: str
    # The KV-cache block size the backend needs, or None for any power of two. The data plane
    # allocates its cache (and reports block_size to the control plane) with this value.
    block_size: int | None
    # The block size where the user names none (`--block-size` left out): the backend's fastest.
    preferred_block_size: int

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: ForwardContext, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Attend causally over each request's cached tokens, the step's new ones included:
        their k/v are already in the cache (the attention layer stores them at
        `ctx.slot_mapping` first).

        q: [num_tokens, num_heads, head_dim];
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
        out: where to write the result (q's shape and dtype, head_dim contiguous), else a new
        tensor. Returns [num_tokens, num_heads, head_dim].
        """
        ...


def kv_block_size(backend: AttentionBackend, asked: int | None) -> int:
    """The KV block size a data plane runs `backend` with: the one it needs, else the one asked
    for (`--block-size`), else its preferred. An asked size the backend overrides is logged."""
    if backend.block_size and asked not in (None, backend.block_size):
        log.warning("attention backend %s needs %d-token KV blocks: block_size %d ignored",
                    backend.name, backend.block_size, asked)
    return backend.block_size or asked or backend.preferred_block_size


def make_backend(name: str, device: str) -> AttentionBackend:
    if name == "auto":
        name = "torch" if device == "cpu" else _best_gpu_backend()
    if name == "torch":
        from dataplane.attention.torch_backend import TorchAttention
        return TorchAttention()
    if name == "triton":  # on CPU only under TRITON_INTERPRET=1 (the kernel tests)
        from dataplane.attention.triton_backend import TritonAttention
        return TritonAttention()
    if name == "triton_fa4":
        from dataplane.attention.flash_attn_backend import fa4_forward_into
        forward_into = fa4_forward_into()
        if forward_into is None:
            raise ValueError("attention backend triton_fa4 needs FlashAttention-4 "
                             "(flash_attn.cute), which does not import (logged above): install "
                             "the fa4 extra, pip install '.[dataplane,fa4]'")
        from dataplane.attention.triton_backend import TritonFa4Attention
        return TritonFa4Attention(forward_into, FA4_MIN_PREFILL_ROWS)
    if name == "flash_attn":
        from dataplane.attention.flash_attn_backend import import_flash_attn
        backend, errors = import_flash_attn()
        if backend is None:
            raise ValueError("attention backend flash_attn cannot be imported: "
                             + "; ".join(errors))
        return backend
    raise ValueError(f"unknown attention backend {name!r} (choose from: {', '.join(BACKENDS)})")


def _best_gpu_backend() -> str:
    """triton_fa4 on Hopper where FlashAttention-4 imports, else triton.

    Our Triton kernels run everywhere: always installed, any block size, a decode kernel that
    spreads any batch's tiles evenly over the GPU, CUDA-graph capturable without warm-up
    compiles per shape. FA4 as the whole backend (`flash_attn`) lost: it has no split-KV on
    Hopper and forces 128-token blocks. On an H200, workload A in-process
    (bench/results/h200/qwen3-0.6b-inprocess-tp1{,-flash-attn}-f25a5ea.json) ran 27,079 tok/s
    on ours, 21,380 on FA4 (decode steps of 256 rows 5.9 against 8.5 ms).

    triton_fa4 keeps our decode kernel and hands FA4 the prompt rows of large steps, where its
    prefill is faster (0.6B heads on an H100, bench/results/h100/prefill_fa4-cfc0eb7.json: a
    16k-token workload-A step 0.164 against 0.206 ms a layer). On its 128-token blocks workload
    A ran faster than on triton on H100s in every session that compared them, by 0.3-1.0%
    split (bench/results/h100/*-{67f28ae,99d124e,cfc0eb7,3b16a97,65c5784}*); as auto at
    84f8284 by 0.6% and 1.0% split, with 37-77 ms less device time a run in-process
    (bench/results/h100/*-84f8284-*). On 16-token blocks it gained nothing (cfc0eb7), and our
    triton on 128-token blocks only ~0.15% (65c5784), so triton keeps 16.

    What it costs: importing FA4 at start-up (~3.5 s), compiling its kernels the first time
    (~12-35 s; later starts load them from FA4's disk cache: configure took 3.6 s against
    triton's 3.2 at 84f8284), 128-token blocks unless `--block-size` names another (cached
    prefixes are shared in whole blocks), and a function private to flash-attn-4 (the backend
    tests check it against the torch reference). The whole GPU suite passes under it (an H100
    at 5f6175e). Only Hopper was measured, so other GPUs keep triton.

    FA4 is optional, so auto never fails on its import: an install that raises anything while
    importing (a CUTLASS DSL built for another CUDA, say) is logged and auto picks triton. An
    explicit `triton_fa4` raises the error instead. The same for a failure later, in FA4's
    first compile at configure: auto goes on with triton on the same blocks on one GPU, an
    explicit triton_fa4 (or TP > 1) raises (ModelRunner.configure)."""
    from dataplane.attention.flash_attn_backend import fa4_forward_into
    if torch.cuda.get_device_capability()[0] != 9:
        return "triton"
    try:
        has_fa4 = fa4_forward_into() is not None
    except Exception as e:  # whatever an optional package raises while importing
        log.warning("FlashAttention-4 failed to import (%s: %s): attention backend auto picks "
                    "triton", type(e).__name__, e)
        return "triton"
    return "triton_fa4" if has_fa4 else "triton"
