"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features over the TP ranks and need no communication;
row-parallel layers split the input features and all-reduce their output. A column layer followed
by a row layer (QKV -> o_proj, gate/up -> down) costs one all-reduce.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this rank's
part of a checkpoint tensor; `loaded` is a safetensors slice (or tensor) so only that part is read.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dataplane.distributed import all_reduce, tp_rank, tp_size
from dataplane.layers.activation import SiluAndMul

_silu_and_mul = SiluAndMul()


def _divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def _rows(loaded, start: int, size: int) -> torch.Tensor:
    """Rows [start, start + size) of a safetensors slice or tensor."""
    return loaded[start:start + size]


def _cols(loaded, start: int, size: int) -> torch.Tensor:
    return loaded[:, start:start + size]


class _Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)


class ReplicatedLinear(_Linear):
    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        param.data.copy_(loaded[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _our_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              gated: bool, before_silu: bool = False) -> torch.Tensor | None:
    """One of our GEMMs' output where it pays (a CUDA batch of decode size, no bias), else
    None: the decode GEMM up to its bounds (kernels/decode_matmul.py: cuBLAS's floor there is ~2x
    the weights' bytes), the TMA GEMM at 177-256 rows and, gated, in prompt steps
    (kernels/tma_matmul.py).
    before_silu: plain, for a separate SiLU-and-mul (decode_matmul_pays)."""
    if not x.is_cuda or bias is not None or x.dim() != 2 or x.stride(1) != 1 \
            or x.dtype != weight.dtype:
        return None
    from dataplane.kernels.decode_matmul import decode_matmul, decode_matmul_pays
    from dataplane.kernels.tma_matmul import tma_matmul, tma_matmul_pays
    n, k = weight.shape
    width = n // 2 if gated else n
    if decode_matmul_pays(x.shape[0], width, k, x.dtype, gated, before_silu):
        return decode_matmul(x, weight, gated=gated)
    if not before_silu and tma_matmul_pays(x, width, k, gated):
        return tma_matmul(x, weight, gated=gated)
    return None


class ColumnParallelLinear(_Linear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, _divide(output_size, tp_size()), bias)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = param.shape[0]
        param.data.copy_(_rows(loaded, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _our_gemm(x, self.weight, self.bias, gated=False)
        return y if y is not None else F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // tp_size()
        size = self.output_sizes[shard_id] // tp_size()
        param.data.narrow(0, offset, size).copy_(_rows(loaded, tp_rank() * size, size))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate | up] projection: [num_tokens, output_sizes[0] / tp].
        On CUDA at small decode sizes, at 177-256 rows and from tma_matmul.PREFILL_MIN_ROWS
        rows (prompt steps) the activation is the GEMM's epilogue; else a kernel after the
        GEMM, which up to decode_matmul.MAX_ROWS_PLAIN_MLP is ours too, so that PDL chains it
        with the norm before and the activation after."""
        assert len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1]
        y = _our_gemm(x, self.weight, self.bias, gated=True)
        if y is not None:
            return y
        y = _our_gemm(x, self.weight, self.bias, gated=False, before_silu=True)
        return _silu_and_mul(y if y is not None else F.linear(x, self.weight, self.bias))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; heads are split over the ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size())
        self.num_kv_heads = _divide(num_kv_heads, tp_size())
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size),
                        "v": (q_size + kv_size, kv_size)}[shard_id]
        param.data.narrow(0, offset, size).copy_(_rows(loaded, tp_rank() * size, size))


class RowParallelLinear(_Linear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 feeds_norm: bool = False) -> None:
        """feeds_norm: the output goes straight into a residual add + RMSNorm (layernorm.RMSNorm),
        which also takes float32 partial sums. On one CUDA device, at the batch sizes where it
        pays, this layer then runs as a split-K GEMM and returns its partials [splits,
        num_tokens, output_size] (kernels/splitk_matmul.py: cuBLAS leaves most SMs idle there).
        A layer with a bias never does."""
        super().__init__(_divide(input_size, tp_size()), output_size, bias)
        self.feeds_norm = feeds_norm and not bias

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 1:  # the bias is added once, on rank 0 (see forward)
            param.data.copy_(loaded[:])
            return
        size = param.shape[1]
        param.data.copy_(_cols(loaded, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.feeds_norm and x.is_cuda and tp_size() == 1:
            from dataplane.kernels.splitk_matmul import splitk_matmul, splitk_pays
            if splitk_pays(x.shape[0], *self.weight.shape, x.dtype):
                return splitk_matmul(x, self.weight)
        bias = self.bias if tp_rank() == 0 else None
        return all_reduce(F.linear(x, self.weight, bias))
