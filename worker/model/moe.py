"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks top-k experts per token.

The tokens of a step are grouped per expert: the (token, expert) pairs are sorted by expert, and
each expert that any token chose runs once on all of its tokens, so a 512-token prefill chunk costs
one matmul per active expert, not one per token. A decode step of a few sequences touches only the
experts those tokens picked. Weighted outputs are summed back per token with index_add_.
"""

from __future__ import annotations

import torch


class SparseMoE(torch.nn.Module):
    def __init__(
        self, router: torch.nn.Module, experts: list[torch.nn.Module], top_k: int, normalize_top_k: bool
    ) -> None:
        """router: hidden -> one logit per expert; normalize_top_k: the chosen weights sum to 1 (Mixtral, Qwen3-MoE)."""
        super().__init__()
        self.router = router
        self.experts = torch.nn.ModuleList(experts)
        self.top_k, self.normalize_top_k = top_k, normalize_top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the top-k experts [T, k] and their weights [T, k] (softmax over all experts, in float32)."""
        probabilities = self.router(x).float().softmax(dim=-1)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        tokens = order // self.top_k  # the token of each (token, expert) pair, grouped by expert
        pair_weights = weights.flatten()[order, None]
        counts = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            group = tokens[start : start + count]
            out.index_add_(0, group, self.experts[expert](x[group]) * pair_weights[start : start + count])
            start += count
        return out
