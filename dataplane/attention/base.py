from typing import Protocol

import torch

from dataplane.forward_context import ForwardContext

BACKENDS = ("auto", "torch", "triton", "triton_fa4", "flash_attn")
# triton_fa4 hands FA4 the prompt rows of steps that bring at least this many, fewer to our
# prefill kernel. A guess, not measured between 2k and 16k rows: at 2 x 1024 rows (0.6B heads)
# ours was faster (h200/kernels.json: 0.063 against 0.077 ms, though FA4 was faster in the
# file's other cases of up to 2,303 rows), and FA4's host time a call, which a small mixed step
# between graph pieces would wait on, was not measured.
FA4_MIN_PREFILL_ROWS = 4096


class AttentionBackend(Protocol):
    name: str
    # The KV-cache block size the backend needs, or None for any power of two. The data plane
    # allocates its cache (and reports block_size to the control plane) with this value.
    block_size: int | None

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

    triton_fa4 (our decode kernel, FA4's prefill) was 0.4-0.6% faster on workload A on an H100
    (bench/results/h100/*-67f28ae*): 0.25% from its 128-token blocks (our triton backend on
    them did as much, its decode steps faster), 0.16% more from FA4 (prompt steps 35.6 against
    36.3 ms; FA4 1.22-1.25x our prefill kernel at workload A's ~560-token prompts, 1.7-2.1x at 8k).
    It stays opt-in: it needs FA4 installed (~10 s to import at start-up, through a function
    private to flash-attn-4), and 128-token blocks share cached prefixes only in whole blocks.
    """
    return "triton"
