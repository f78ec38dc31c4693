"""Mixture-of-experts quantities: the router's load-balancing loss and the routing metrics.

Pure tensor functions (no process groups, no modules). Shapes: ``T`` routed tokens, ``E`` experts, ``K`` experts per
token (top-k), ``N`` MoE layers. Expert choices are int tensors ``(..., K)``; ``-1`` marks a token whose choice is not
known (a rollout that never ran it, padding).

* ``load_balancing_loss``: the Switch Transformer auxiliary loss (Fedus et al. 2021, arXiv 2101.03961, eqs. 4-6) in
  the form transformers' ``load_balancing_loss_func`` computes for Qwen2-MoE / Qwen3-MoE: the layers' rows are pooled
  (fractions and mean probabilities over all ``N x T`` rows), then ``E * sum_e f_e * P_e``. 1.0 at perfect balance
  (for top-k routing, ``K`` times that of top-1).
* ``same_expert_set``: per token, whether two routings picked the same set of experts (order ignored): the share of
  such tokens is the routing agreement between the rollout engine and the trainer.
* ``expert_counts``: tokens per expert per layer, for the load metric (max / mean tokens per expert).
"""

from __future__ import annotations

import torch
from torch import Tensor


def load_balancing_loss(logits: list[Tensor], *, top_k: int, mask_T: Tensor | None = None) -> Tensor:
    """Auxiliary load-balancing loss over MoE layers.

    Args:
        logits: per MoE layer, the router logits ``(T, E)`` of the same ``T`` tokens.
        top_k: experts per token.
        mask_T: ``(T,)`` 1.0 for tokens that count, 0.0 for padding (None: all count).

    Returns:
        0-dim float32: ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k assignments to expert ``e`` and ``P_e``
        its mean router probability, both over every (layer, counted token) pair. Differentiable through ``P_e``
        (the assignment counts are constants, as in the paper).
    """
    assert logits, "no MoE layer"
    E = logits[0].shape[-1]
    dev = logits[0].device
    assignments = torch.zeros(E, dtype=torch.float32, device=dev)
    probs = torch.zeros(E, dtype=torch.float32, device=dev)
    rows = torch.zeros((), dtype=torch.float32, device=dev)
    for layer in logits:
        p = torch.softmax(layer.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        w = torch.ones(layer.shape[0], device=dev) if mask_T is None else mask_T.float()
        assignments = assignments.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (p * w[:, None]).sum(0)
        rows = rows + w.sum()
    rows = rows.clamp(min=1)
    return E * ((assignments / rows) * (probs / rows)).sum()


def same_expert_set(a: Tensor, b: Tensor) -> Tensor:
    """``(..., K)`` expert choices -> ``(...)`` bool: the same set of ``K`` experts (in any order). A row with an
    unknown choice (``-1``) in either is False."""
    known = (a >= 0).all(-1) & (b >= 0).all(-1)
    return known & (a.sort(-1).values == b.sort(-1).values).all(-1)


def expert_counts(chosen_TNK: Tensor, *, num_experts: int, mask_T: Tensor | None = None) -> Tensor:
    """``(T, N, K)`` expert choices -> ``(N, E)`` float64 tokens per expert per layer (tokens with ``mask_T`` 0 and
    unknown choices not counted)."""
    T, N, K = chosen_TNK.shape
    valid = chosen_TNK >= 0
    if mask_T is not None:
        valid = valid & (mask_T > 0)[:, None, None]
    index = (torch.arange(N, device=chosen_TNK.device)[None, :, None] * num_experts + chosen_TNK.clamp(min=0)).reshape(
        -1
    )
    counts = torch.zeros(N * num_experts, dtype=torch.float64, device=chosen_TNK.device)
    counts.index_add_(0, index, valid.reshape(-1).double())
    return counts.view(N, num_experts)
