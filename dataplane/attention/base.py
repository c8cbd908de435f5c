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
        from dataplane.attention.triton_backend import TritonFa4Attention
        forward_into = fa4_forward_into()
        if forward_into is None:
            raise ValueError("attention backend triton_fa4 needs FlashAttention-4 "
                             "(flash_attn.cute), which does not import")
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
    """Our Triton kernels: always installed, any block size, a decode kernel that spreads any
    batch's tiles evenly over the GPU, CUDA-graph capturable without warm-up compiles per shape.
    FlashAttention-4 has no split-KV on Hopper, forces 128-token blocks and takes ~10 s to
    import; it stays opt-in (`flash_attn`). Measured on an H200, workload A in-process
    (bench/results/h200/qwen3-0.6b-inprocess-tp1{,-flash-attn}-f25a5ea.json): 27,079 tok/s on
    ours, 21,380 on FA4 (decode steps of 256 rows 5.9 against 8.5 ms, prompt steps 34.9 against
    37.7 ms).

    triton_fa4 (our decode kernel, FA4's prefill) was faster on workload A on H100s: by 0.4-0.6%
    at 67f28ae, by 0.6% and 1.0% split and 0.05% and 0.8% in-process at 99d124e
    (bench/results/h100/*-67f28ae*, *-99d124e*): its prompt steps 36.1-36.2 ms against
    36.6-36.8, its decode steps 0.02-0.04 ms faster at 128-256 rows on 128-token blocks. Our
    triton backend on 128-token blocks gained 0.25% at 67f28ae and lost 0.3-0.8% at 99d124e.
    It stays opt-in: it needs FA4 installed (~10 s to import at start-up, through a function
    private to flash-attn-4), and its gain comes with 128-token blocks, which share cached
    prefixes only in whole blocks. It runs on any block size (FA4 gathers the keys of other
    sizes with cp.async, 5-12% slower than its TMA path on 128), but at cfc0eb7 on an H100
    (bench/results/h100/*-cfc0eb7*) 16-token blocks gave nothing on workload A: split
    21,487-21,561 tok/s in three runs against triton's 21,491-21,528 in four. On 128-token
    blocks, 21,593-21,607 in two, the gain was in the decode steps (18-28 ms less a run); the
    prompt steps were faster on 16-token blocks (35.1-35.3 ms against 35.7-35.8; triton's
    36.3-36.7). So triton_fa4 takes 128-token blocks unless told otherwise.

    At 65c5784 (bench/results/h100/*-65c5784-r*, one H100, in-process device time against
    triton on 16-token blocks): triton_fa4 ~25 ms less a run (~0.4%), triton on 128-token
    blocks ~9 ms (~0.15%), on 64 nothing. A data plane on triton_fa4 loaded ~3.5 s slower there
    and configured ~11 s slower while FA4 compiled (2.7 s in all once FA4's disk cache held its
    kernels, 0d29efd). As auto (b5ed488) it failed three float32 GPU tests before 52fbd1c; it
    waits for a GPU run of fa4-tests and smoke.
    """
    return "triton"
