"""FlashAttention over the paged cache, when it is importable: FlashAttention-4
(`flash_attn.cute`, CuTe DSL, Hopper/Blackwell) first, else the FlashAttention 2.x API.

The attention layer stores new K/V first; FlashAttention reads everything from the cache.

Block sizes (exposed as `block_size`; the data plane must allocate the cache with it):
- FA4 on SM90 loads pages with TMA when a page is one key tile (128 tokens at head_dim 128) and
  with cp.async at 256; it has no split-KV there and `page_table` cannot be combined with
  `cu_seqlens_k`, so keys are described by `seqused_k` alone. We use 128.
- FA 2.x needs pages that are multiples of 256 tokens for `block_table`.
"""

import getpass
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dataplane.forward_context import ForwardContext

log = logging.getLogger("splitserve.dataplane")


class FlashAttention4:
    name = "flash_attn"
    block_size: int | None = 128
    preferred_block_size = 128

    def __init__(self, varlen_fn: Callable) -> None:
        self.varlen_fn = varlen_fn  # flash_attn.cute.flash_attn_varlen_func

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: ForwardContext, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        # Causal masks align to the end of each sequence: query i of a request sees keys up to
        # seqused_k - q_len + i, which is our position convention.
        result, _ = self.varlen_fn(q, k_cache, v_cache, cu_seqlens_q=ctx.query_start_loc,
                                   max_seqlen_q=ctx.max_query_len, seqused_k=ctx.seq_lens,
                                   max_seqlen_k=ctx.max_seq_len, page_table=ctx.block_tables,
                                   softmax_scale=scale, causal=True)
        return _into(out, result)


class FlashAttention2:
    name = "flash_attn"
    block_size: int | None = 256
    preferred_block_size = 256

    def __init__(self, varlen_fn: Callable, kvcache_fn: Callable) -> None:
        self.varlen_fn = varlen_fn  # flash_attn.flash_attn_varlen_func
        self.kvcache_fn = kvcache_fn  # flash_attn.flash_attn_with_kvcache

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                ctx: ForwardContext, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if ctx.max_query_len == 1 and q.shape[0] == ctx.seq_lens.shape[0]:
            result = self.kvcache_fn(q.unsqueeze(1), k_cache, v_cache,
                                     cache_seqlens=ctx.seq_lens, block_table=ctx.block_tables,
                                     softmax_scale=scale, causal=True)
            return _into(out, result.squeeze(1))  # [num_reqs, heads, head_dim]
        cu_seqlens_k = F.pad(torch.cumsum(ctx.seq_lens, 0, dtype=torch.int32), (1, 0))
        return _into(out, self.varlen_fn(
            q, k_cache, v_cache, cu_seqlens_q=ctx.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=ctx.max_query_len, max_seqlen_k=ctx.max_seq_len, softmax_scale=scale,
            causal=True, block_table=ctx.block_tables))


FA4_DTYPES = (torch.float16, torch.bfloat16)  # FA4 asserts on anything else (float32)
# FA4 compiles another kernel for a launch whose longest query, times the query heads per KV
# head, fits one tile of rows (its static persistent schedule: at most q_stage x tile_m rows,
# 128 on Hopper at head_dim 128, up to 256 with other tiles and chips; interface.py of
# flash-attn-4 4.0.0b36). Configure's warm-up meets only the other, and a compile inside a
# served step holds the GIL for seconds (the link stops heartbeating, as seen at configure on
# an H100).
FA4_MAX_ONE_TILE_ROWS = 256


def fa4_paged_prefill_fits(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int) -> bool:
    """Whether FA4 takes these prompt rows with the kernel configure compiled: half precision,
    and a longest query past one of its row tiles (steps of only short prompts would compile
    another). q: [rows, heads, head_dim]; k_cache: [blocks, block_size, kv_heads, head_dim]."""
    return q.dtype in FA4_DTYPES and \
        max_query_len * (q.shape[1] // k_cache.shape[2]) > FA4_MAX_ONE_TILE_ROWS


@dataclass(frozen=True)
class Fa4PagedPrefill:
    """FA4's paged varlen forward over a step's prompt rows, prepared once a forward and run by
    every layer with PagedLaunch's call shape (q, k_cache, v_cache, out). The triton_fa4 backend
    hands it a step's prompt rows, after its one-token requests; cu_seqlens_q counts from them."""

    forward_into: Callable  # fa4_forward_into()'s function
    cu_seqlens_q: torch.Tensor  # [num_prompt_requests + 1] int32
    seqused_k: torch.Tensor  # [num_prompt_requests] int32: cached + new tokens
    page_table: torch.Tensor  # [num_prompt_requests, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor) -> None:
        self.forward_into(q, k_cache, v_cache, out, cu_seqlens_q=self.cu_seqlens_q,
                          max_seqlen_q=self.max_seqlen_q, seqused_k=self.seqused_k,
                          max_seqlen_k=self.max_seqlen_k, page_table=self.page_table,
                          softmax_scale=self.scale, causal=True)


def fa4_forward_into() -> Callable | None:
    """FA4's forward writing into a given `out`, or None when flash_attn.cute does not import.
    The public flash_attn_varlen_func allocates its output (a copy into ours would move as many
    bytes again as the kernel writes) and goes through autograd; the module function under it
    takes `out`. It is private to flash-attn-4 (4.0.0b36 in fa4-bundle.sh): the backend tests
    check it against the torch reference. Why it does not import is logged (a missing package
    of the fa4 extra, or a flash-attn-4 without that function): auto's pick and triton_fa4's
    error follow from it."""
    _keep_fa4_kernels_on_disk()
    try:
        from flash_attn.cute.interface import _flash_attn_fwd
    except ImportError as e:
        log.info("FlashAttention-4's forward does not import: %s", e)
        return None
    _quiet_fa4_compile_warning()

    def forward_into(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, **kwargs) -> None:
        try:
            _flash_attn_fwd(q, k_cache, v_cache, out=out, **kwargs)
        except _DEVICE_ERRORS:
            raise  # the device's, not FA4's: they fail a data plane as in any other kernel
        except Exception as e:  # its CuTe DSL compile raises several kinds
            raise Fa4Error(f"{type(e).__name__}: {e}") from e
    return forward_into


class Fa4Error(RuntimeError):
    """FlashAttention-4's forward failed (typically its first compile of a kernel), other than
    by running out of device memory or a CUDA error: auto's triton_fa4 falls back to triton at
    configure on this (ModelRunner.configure)."""


# (torch.AcceleratorError: a CUDA error, where this torch has that class)
_DEVICE_ERRORS = (torch.OutOfMemoryError,
                  getattr(torch, "AcceleratorError", torch.OutOfMemoryError))


# What the CuTe DSL warns at each first compile of FA4's forward: flash-attn-4 (4.0.0b36) passes
# it an argument it cannot type, a UserWarning that names the whole kernel, and the kernel is
# right (the backend tests check it against the torch reference). It filled a screen of every
# triton_fa4 data plane's log.
FA4_COMPILE_WARNING = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"


def _quiet_fa4_compile_warning() -> None:
    """Drop that warning in this process (it is the only one matched: the message is specific),
    once FA4 imports."""
    warnings.filterwarnings("ignore", message=FA4_COMPILE_WARNING, category=UserWarning)


def _keep_fa4_kernels_on_disk() -> None:
    """FA4's own cache of compiled kernels on disk (FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, else
    <temp dir>/<user name>/flash_attention_cute_dsl_cache), on unless the environment says
    otherwise: a data plane restarted on the same host (after a crash, say) loads the kernels
    instead of compiling them again. On an H100, a 0.6B triton_fa4 data plane with Triton's
    cache warm configured in 15 s without it, 2.7 s with it
    (bench/results/h100/serve-*-triton-fa4-{65c5784,0d29efd}-*). FA4 reads the setting when
    flash_attn.cute is first imported and then creates the default directory, which needs a user
    name (a container's arbitrary uid may have none) and a writable temp dir: without either,
    the cache stays off rather than failing the import."""
    if "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED" in os.environ:
        return
    if "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR" not in os.environ:
        try:
            getpass.getuser()
        except (KeyError, OSError):
            return
        if not os.access(tempfile.gettempdir(), os.W_OK):
            return
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """The FlashAttention functions write where they choose: copy into `out` when one is given."""
    return result if out is None else out.copy_(result)


def load_flash_attn() -> FlashAttention4 | FlashAttention2 | None:
    """The FlashAttention backend that imports here, FA4 first; None when neither does.
    Importing flash_attn.cute takes ~10 s (CuTe DSL); call this once, at start-up."""
    return import_flash_attn()[0]


def import_flash_attn() -> tuple[FlashAttention4 | FlashAttention2 | None, list[str]]:
    """(backend or None, the import errors met on the way): a half-installed FlashAttention
    (FA4 also needs nvidia-cutlass-dsl, quack-kernels and einops) should say what is missing."""
    errors = []
    _keep_fa4_kernels_on_disk()
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
        _quiet_fa4_compile_warning()
        return FlashAttention4(fa4_varlen), errors
    except ImportError as e:
        errors.append(f"flash_attn.cute (FA4): {e}")
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        return FlashAttention2(flash_attn_varlen_func, flash_attn_with_kvcache), errors
    except ImportError as e:
        errors.append(f"flash_attn (2.x): {e}")
    return None, errors
