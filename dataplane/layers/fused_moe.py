"""Mixture-of-experts: a router picks each token's top-k experts; the experts are SiLU-gated MLPs.

Tensor parallel like the dense MLP: every expert's intermediate dimension is split over the TP
ranks (gate/up by rows, down by columns), so each rank computes a partial sum of every token's
output and one all-reduce per layer completes it. The router is replicated.

Each rank stores its experts stacked, `w13 [E, 2 * I/tp, H]` (gate rows, then up rows) and
`w2 [E, H, I/tp]`, the layout the fused kernel reads. On CUDA the experts run as the fused Triton
kernel (dataplane/kernels/fused_moe.py); elsewhere `moe_reference` runs them, which is also the
oracle that kernel is tested against.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from dataplane.distributed import all_reduce, tp_rank, tp_size

# hub checkpoints (and transformers 4.x / 5.x save_pretrained): one tensor per expert and projection
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# transformers 5.x save_pretrained(save_original_format=False): the experts already stacked
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def expert_weight_route(name: str) -> tuple[str, tuple[int | None, str]] | None:
    """A checkpoint tensor of the experts -> (our parameter name, (expert id or None for all
    experts, checkpoint projection name)); None for any other tensor."""
    match = _PER_EXPERT.match(name) or _STACKED.match(name)
    if match is None:
        return None
    proj = match["proj"]
    param = "w2" if proj == "down_proj" else "w13"
    expert = int(match["expert"]) if "expert" in match.groupdict() else None
    return f"{match['prefix']}.{param}", (expert, proj)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, top-k, optionally renormalized to sum to 1 (Qwen3-MoE's
    norm_topk_prob). Returns weights [T, top_k] float32 and expert ids [T, top_k] int64."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, num_experts]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, top_k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Group the (token, k) pairs by expert, run each expert on its tokens, add the weighted
    outputs up (in float32). Shapes as in `dataplane.kernels.fused_moe.fused_moe`."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    pair_ids = torch.argsort(flat_ids, stable=True)  # [T * top_k] grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for expert, pairs in enumerate(pair_ids.split(counts)):
        if len(pairs) == 0:
            continue
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        out.index_add_(0, tokens, y.float() * topk_weights.flatten()[pairs, None])
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one MoE layer (this rank's shard); forward takes the router's logits."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        assert intermediate_size % tp_size() == 0, (intermediate_size, tp_size())
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size  # all ranks together
        shard = intermediate_size // tp_size()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, shard), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self._loaded: set[tuple[int, str]] = set()  # (expert, projection) seen by weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, expert: int | None, proj: str) -> None:
        """Copy this rank's slice of one expert's projection (`expert` set: [I, H] or [H, I]) or
        of all experts' (`expert` None: [E, 2I, H] or [E, H, I]); `loaded` is a safetensors slice,
        so only that slice is read."""
        shard = param.shape[2] if proj == "down_proj" else param.shape[1] // 2
        start = tp_rank() * shard
        projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
        experts = range(param.shape[0]) if expert is None else (expert,)
        self._loaded.update((e, p) for e in experts for p in projs)
        if expert is not None:
            self._load_expert(param.data[expert], loaded, proj, start, shard)
        elif proj == "gate_up_proj":
            param.data[:, :shard].copy_(loaded[:, start:start + shard])
            up = self.intermediate_size + start
            param.data[:, shard:].copy_(loaded[:, up:up + shard])
        else:
            param.data.copy_(loaded[:, :, start:start + shard])

    def missing_weights(self) -> list[str]:
        """Expert projections no checkpoint tensor has filled (the loader checks after loading)."""
        return [f"experts.{e}.{p}" for e in range(self.w13.shape[0])
                for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in self._loaded]

    @staticmethod
    def _load_expert(dst: torch.Tensor, loaded, proj: str, start: int, shard: int) -> None:
        if proj == "down_proj":
            dst.copy_(loaded[:, start:start + shard])  # [H, I/tp]
        else:
            half = 0 if proj == "gate_proj" else shard
            dst[half:half + shard].copy_(loaded[start:start + shard])  # [I/tp, H]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H], router_logits: [T, num_experts] -> [T, H], summed over the TP ranks."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if x.is_cuda:
            from dataplane.kernels.fused_moe import fused_moe
            out = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = moe_reference(x, self.w13, self.w2, weights, ids)
        return all_reduce(out)
