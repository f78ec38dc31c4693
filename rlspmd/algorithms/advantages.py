"""Advantage estimators: pure tensor functions from rewards (and values) to per-token advantages.

Shapes use suffixes: `_B` per sequence, `_BT` per token, where T is the response length (the prompt is not in
these tensors). `mask_BT` is 1.0 for response tokens that count and 0.0 for padding AND for tool / observation tokens
inside a multi-turn response; such holes are skipped by the recursions below, never treated as episode ends.

Every estimator returns `(advantages_BT, returns_BT)` with 0 at masked positions, and runs without autograd
(advantages are constants of the policy loss). The group estimators (GRPO, RLOO, OPO, GPG, GDPO, ...) take
`group_ids_B`, an integer id per row naming the prompt it answers; rows may come in any order and a group's rows
need not be adjacent. For these outcome estimators `returns_BT` is the advantage itself (there is no critic to fit).

Groups follow verl (`verl/trainer/ppo/core_algos.py`) so that a user switching gets the same numbers:
* a group holding a single sample has mean 0 and std 1, so it keeps its score (GRPO: score / (1 + eps) with the std
  division, the raw score without; RLOO, OPO, REINFORCE++-baseline and GPG: the raw score);
* a group of two or more samples whose scores are all equal gets exactly 0. verl computes (s - mean) / (0 + eps)
  there, which is 0 up to the mean's last-bit rounding error divided by eps; we make it exactly 0.

Whitening: none of the estimators here whitens except the REINFORCE++ variants and GDPO (whose definitions
include it). PPO with GAE whitens advantages across the GLOBAL batch in the trainer: `masked_moments` on each rank,
one all-reduce, then `masked_whiten(..., moments=global_moments)`. The same works for the others: whiten the
REINFORCE++ `returns_BT` / centred scores and `gdpo_combine`'s output with global moments instead of the local
whitening the library functions apply.
"""

from __future__ import annotations

import torch
from torch import Tensor


# ----------------------------------------------------------------------------------------------------------------
# Helpers shared by the estimators


def _as_float(x: Tensor) -> Tensor:
    # Rewards may arrive as ints or bf16; group statistics need at least fp32.
    if not x.is_floating_point() or torch.finfo(x.dtype).bits < 32:
        return x.float()
    return x


def _check_B(name: str, x_B: Tensor, mask_BT: Tensor) -> None:
    if mask_BT.dim() != 2:
        raise ValueError(f"mask_BT must be 2-D (B, T), got shape {tuple(mask_BT.shape)}")
    if x_B.shape != mask_BT.shape[:1]:
        raise ValueError(
            f"{name} must have shape ({mask_BT.shape[0]},) to match mask_BT {tuple(mask_BT.shape)}, "
            f"got {tuple(x_B.shape)}"
        )


def _check_BT(name: str, x_BT: Tensor, mask_BT: Tensor) -> None:
    if x_BT.shape != mask_BT.shape or mask_BT.dim() != 2:
        raise ValueError(f"{name} must have the 2-D shape of mask_BT {tuple(mask_BT.shape)}, got {tuple(x_BT.shape)}")


def _groups(group_ids_B: Tensor, B: int) -> tuple[Tensor, int]:
    """Map arbitrary per-row ids to dense group indices 0..G-1 (no ordering or contiguity assumed)."""
    if group_ids_B.dim() != 1 or group_ids_B.shape[0] != B:
        raise ValueError(f"group_ids_B must have shape ({B},), got {tuple(group_ids_B.shape)}")
    if group_ids_B.is_floating_point() or group_ids_B.is_complex() or group_ids_B.dtype == torch.bool:
        raise ValueError(f"group_ids_B must be an integer tensor (one id per prompt), got {group_ids_B.dtype}")
    unique_G, inv_B = torch.unique(group_ids_B, return_inverse=True)
    return inv_B, unique_G.numel()


def _group_sum(x_B: Tensor, inv_B: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=x_B.dtype, device=x_B.device).index_add_(0, inv_B, x_B)


def _group_reduce(x_B: Tensor, inv_B: Tensor, num_groups: int, op: str) -> Tensor:
    init = float("-inf") if op == "amax" else float("inf")
    out_G = torch.full((num_groups,), init, dtype=x_B.dtype, device=x_B.device)
    return out_G.scatter_reduce_(0, inv_B, x_B, reduce=op, include_self=True)


def _group_stats(s_B: Tensor, inv_B: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, mean, unbiased std) with verl's convention for a group of one: mean 0 and std 1, so the
    singleton keeps its score (`compute_grpo_outcome_advantage` in verl's core_algos.py)."""
    n_G = _group_sum(torch.ones_like(s_B), inv_B, num_groups)
    mean_G = _group_sum(s_B, inv_B, num_groups) / n_G
    dev_B = s_B - mean_G[inv_B]
    var_G = _group_sum(dev_B * dev_B, inv_B, num_groups) / (n_G - 1).clamp(min=1)
    single_G = n_G == 1
    return n_G, torch.where(single_G, 0.0, mean_G), torch.where(single_G, 1.0, var_G.sqrt())


def _zero_variance(s_B: Tensor, inv_B: Tensor, num_groups: int) -> Tensor:
    # Exact comparison: a computed mean of equal floats can differ from them in the last bit, so testing
    # "score - mean == 0" would leave ~1e-11 advantages after dividing by std + eps.
    max_G = _group_reduce(s_B, inv_B, num_groups, "amax")
    min_G = _group_reduce(s_B, inv_B, num_groups, "amin")
    return (max_G == min_G)[inv_B]


def _degenerate(s_B: Tensor, inv_B: Tensor, num_groups: int, n_G: Tensor) -> Tensor:
    """Rows of a group of two or more samples whose scores are all equal: exactly 0 advantage."""
    return _zero_variance(s_B, inv_B, num_groups) & (n_G > 1)[inv_B]


def _broadcast(adv_B: Tensor, mask_BT: Tensor) -> Tensor:
    return adv_B.unsqueeze(-1) * mask_BT.to(adv_B.dtype)


@torch.no_grad()
def zero_variance_rows(scores_B: Tensor, group_ids_B: Tensor, *, include_singletons: bool = True) -> Tensor:
    """Which rows belong to a group whose scores are all equal.

    Groups of two or more such rows give every group-relative estimator a zero advantage; DAPO's dynamic sampling
    drops them. A group of one is "all equal" too and is included by default; verl's dynamic sampling keeps
    singletons (they keep their score as advantage, see the module docstring): pass `include_singletons=False`
    for that. Args: scores_B (B,), group_ids_B (B,) integer ids in any order. Returns: (B,) bool.
    """
    s_B = _as_float(scores_B)
    inv_B, num_groups = _groups(group_ids_B, s_B.shape[0])
    if include_singletons:
        return _zero_variance(s_B, inv_B, num_groups)
    n_G = _group_sum(torch.ones_like(s_B), inv_B, num_groups)
    return _degenerate(s_B, inv_B, num_groups, n_G)


@torch.no_grad()
def token_level_scores(scores_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Place each sequence's scalar score on its last valid response token (the input GAE and REINFORCE++ use).

    Args:
        scores_B: (B,) outcome score per sequence.
        mask_BT: (B, T) response mask.

    Returns:
        (B, T) zeros except `scores_B[i]` at the last position where `mask_BT[i] > 0`. A row with no valid token
        gets all zeros (its score has nowhere to go; such rows are padding).
    """
    _check_B("scores_B", scores_B, mask_BT)
    s_B = _as_float(scores_B)
    B, T = mask_BT.shape
    out_BT = torch.zeros(B, T, dtype=s_B.dtype, device=s_B.device)
    if T == 0:
        return out_BT
    positions_BT = torch.arange(T, device=mask_BT.device).expand(B, T)
    last_B = torch.where(mask_BT > 0, positions_BT, -1).amax(dim=-1)
    has_valid_B = last_B >= 0
    rows = torch.arange(B, device=mask_BT.device)[has_valid_B]
    out_BT[rows, last_B[has_valid_B]] = s_B[has_valid_B]
    return out_BT


@torch.no_grad()
def masked_moments(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Sufficient statistics `[count, sum, sum of squares]` of `x_BT` over valid tokens, as one float64 (3,) tensor.

    Sum it over DP ranks with a single all-reduce and pass it to `masked_whiten(..., moments=...)` to whiten across
    the global batch. float64 keeps the sum-of-squares variance formula accurate.
    """
    _check_BT("x_BT", x_BT, mask_BT)
    valid_BT = mask_BT > 0
    x_BT = torch.where(valid_BT, x_BT.to(torch.float64), 0.0)
    return torch.stack([valid_BT.sum().to(torch.float64), x_BT.sum(), (x_BT * x_BT).sum()])


@torch.no_grad()
def masked_whiten(
    x_BT: Tensor, mask_BT: Tensor, *, shift_mean: bool = True, eps: float = 1e-8, moments: Tensor | None = None
) -> Tensor:
    """Normalise `x_BT` to zero mean and unit variance over its valid tokens.

    Args:
        x_BT: (B, T) values, e.g. GAE advantages.
        mask_BT: (B, T) response mask; statistics use only positions with `mask_BT > 0`.
        shift_mean: if False the mean is added back (only the scale changes), as some PPO variants do.
        eps: added to the variance before the square root.
        moments: `[count, sum, sum_sq]` from `masked_moments`, all-reduced over ranks, to whiten with the global
            batch's statistics. Default: this batch's own.

    Returns:
        (B, T) `(x - mean) / sqrt(var + eps)` (plus `mean` when `shift_mean=False`), 0 at masked positions. The
        variance is unbiased (divides by count - 1); with a single valid token it is 0, and with none the result
        is all zeros.
    """
    if moments is None:
        moments = masked_moments(x_BT, mask_BT)
    else:
        _check_BT("x_BT", x_BT, mask_BT)
    count, total, total_sq = moments.to(device=x_BT.device, dtype=torch.float64).unbind()
    # No branch on count (that would sync a GPU): with count == 0 every position is masked and comes out 0.
    mean = total / count.clamp(min=1)
    var = ((total_sq - count * mean * mean) / (count - 1).clamp(min=1)).clamp(min=0)
    whitened_BT = (x_BT.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened_BT = whitened_BT + mean
    return torch.where(mask_BT > 0, whitened_BT, 0.0).to(x_BT.dtype)


def _discounted_sum_skipping_holes(rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over valid tokens only, where `next` is the next VALID token (0 past the last)."""
    valid_BT = mask_BT > 0
    running_B = torch.zeros(rewards_BT.shape[0], dtype=rewards_BT.dtype, device=rewards_BT.device)
    out_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        g_B = rewards_BT[:, t] + gamma * running_B
        out_BT[:, t] = torch.where(valid_BT[:, t], g_B, 0.0)
        running_B = torch.where(valid_BT[:, t], g_B, running_B)
    return out_BT


# ----------------------------------------------------------------------------------------------------------------
# Token-level estimators (use per-token rewards; the critic's values for GAE)


@torch.no_grad()
def gae(rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation for PPO.

    Schulman et al. 2015, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
    arXiv 1506.02438:  delta_t = r_t + gamma * V_next - V_t,  A_t = delta_t + gamma * lam * A_next.

    Multi-turn: a masked position inside the response (a tool / observation token) is skipped, not an episode end:
    for a valid token the "next" token is the next VALID one, so its next value is the value there. The episode ends
    after the last valid token (V_next = 0, A_next = 0). Advantages at valid tokens are therefore identical to those
    of the same sequence with the holes cut out. Rewards and values at masked positions are ignored.

    Args:
        rewards_BT: (B, T) per-token rewards (e.g. `token_level_scores` minus a KL penalty).
        values_BT: (B, T) critic values V(s_t) of the rollout.
        mask_BT: (B, T) response mask.
        gamma: discount; lam: GAE lambda.

    Returns:
        `(advantages_BT, returns_BT)`, returns = advantages + values (the critic's target), both 0 where masked.
        Not whitened: PPO whitens across the global batch in the trainer (see `masked_whiten`).
    """
    _check_BT("rewards_BT", rewards_BT, mask_BT)
    _check_BT("values_BT", values_BT, mask_BT)
    rewards_BT = _as_float(rewards_BT)
    values_BT = values_BT.to(rewards_BT.dtype)
    valid_BT = mask_BT > 0
    B, T = rewards_BT.shape
    next_value_B = torch.zeros(B, dtype=rewards_BT.dtype, device=rewards_BT.device)
    next_adv_B = torch.zeros_like(next_value_B)
    adv_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(T)):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        adv_BT[:, t] = torch.where(valid_BT[:, t], adv_B, 0.0)
        next_value_B = torch.where(valid_BT[:, t], values_BT[:, t], next_value_B)
        next_adv_B = torch.where(valid_BT[:, t], adv_B, next_adv_B)
    returns_BT = torch.where(valid_BT, adv_BT + values_BT, 0.0)
    return adv_BT, returns_BT


@torch.no_grad()
def reinforce_pp(token_rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch.

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models", arXiv 2501.03262.
    G_t = r_t + gamma * G_next, skipping masked tokens exactly as `gae` does (a hole is not an episode end; rewards
    at masked positions are ignored). `token_rewards_BT` may already include a per-token KL penalty
    (`apply_kl_in_reward`), which is how REINFORCE++ regularises.

    Args:
        token_rewards_BT: (B, T) per-token rewards (outcome score on the last valid token, minus KL).
        mask_BT: (B, T) response mask.
        gamma: discount.

    Returns:
        `(advantages_BT, returns_BT)`: advantages = `masked_whiten(G)` over this batch's valid tokens; returns = G
        unwhitened. To whiten across DP ranks instead, whiten `returns_BT` with global `masked_moments`.
    """
    _check_BT("token_rewards_BT", token_rewards_BT, mask_BT)
    returns_BT = _discounted_sum_skipping_holes(_as_float(token_rewards_BT), mask_BT, gamma=gamma)
    return masked_whiten(returns_BT, mask_BT), returns_BT


# ----------------------------------------------------------------------------------------------------------------
# Outcome estimators (one scalar score per sequence, broadcast to its tokens)


def _group_normalise(s_B: Tensor, inv_B: Tensor, num_groups: int, *, norm_by_std: bool, eps: float) -> Tensor:
    """(s - group mean) [/ (group std + eps)] per row, verl's singleton convention, exact 0 for all-equal groups."""
    n_G, mean_G, std_G = _group_stats(s_B, inv_B, num_groups)
    adv_B = s_B - mean_G[inv_B]
    if norm_by_std:
        adv_B = adv_B / (std_G[inv_B] + eps)
    return torch.where(_degenerate(s_B, inv_B, num_groups, n_G), 0.0, adv_B)


@torch.no_grad()
def grpo_outcome(
    scores_B: Tensor, mask_BT: Tensor, group_ids_B: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage: (score - group mean) / (group std + eps), the same for every token.

    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    arXiv 2402.03300. `norm_by_std=False` drops the division, which is Dr.GRPO (Liu et al. 2025, "Understanding
    R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783). Matches verl's
    `compute_grpo_outcome_advantage` (core_algos.py).

    The std is the UNBIASED one (divides by n - 1, `torch.std`'s default), as in verl. A singleton group has mean 0
    and std 1: its advantage is score / (1 + eps), or the raw score with `norm_by_std=False`. A group of two or
    more whose scores are all equal gets exactly 0.

    Args:
        scores_B: (B,) outcome score per sequence.
        mask_BT: (B, T) response mask.
        group_ids_B: (B,) integer prompt id per row, any order.
        norm_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std (`GRPO.eps`).

    Returns:
        `(advantages_BT, returns_BT)`, the same tensor twice, 0 at masked positions.
    """
    _check_B("scores_B", scores_B, mask_BT)
    s_B = _as_float(scores_B)
    inv_B, num_groups = _groups(group_ids_B, s_B.shape[0])
    adv_BT = _broadcast(_group_normalise(s_B, inv_B, num_groups, norm_by_std=norm_by_std, eps=eps), mask_BT)
    return adv_BT, adv_BT


@torch.no_grad()
def grpo_passk(
    scores_B: Tensor, mask_BT: Tensor, group_ids_B: Tensor, *, eps: float = 1e-6, norm_by_std: bool = True
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO: only the best response of each group gets a non-zero advantage, best minus second best.

    Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using Reinforcement Learning",
    arXiv 2503.19595: for the pass@k objective with k = group size, the leave-one-out control variate leaves a
    gradient only on the group's maximum, weighted by max - second max. verl: `compute_grpo_passk_outcome_advantage`.

    The best row is the first row (in batch order) holding the group maximum; with a tie the gap is 0, so the
    whole group gets 0. With `norm_by_std` the gap is divided by the group's unbiased std + eps. A singleton group
    has no second best and gets 0 (verl raises an error there instead; a run with one sample per prompt keeps going).

    Args:
        scores_B: (B,) outcome scores; mask_BT: (B, T); group_ids_B: (B,) integer ids in any order.

    Returns:
        `(advantages_BT, returns_BT)`, the same tensor twice, 0 at masked positions.
    """
    _check_B("scores_B", scores_B, mask_BT)
    s_B = _as_float(scores_B)
    B = s_B.shape[0]
    inv_B, num_groups = _groups(group_ids_B, B)
    n_G, _, std_G = _group_stats(s_B, inv_B, num_groups)
    max_G = _group_reduce(s_B, inv_B, num_groups, "amax")
    rows_B = torch.arange(B, device=s_B.device)
    candidate_B = torch.where(s_B == max_G[inv_B], rows_B, B)
    best_row_G = torch.full((num_groups,), B, dtype=rows_B.dtype, device=s_B.device)
    best_row_G.scatter_reduce_(0, inv_B, candidate_B, reduce="amin", include_self=True)
    is_best_B = rows_B == best_row_G[inv_B]
    second_G = _group_reduce(torch.where(is_best_B, float("-inf"), s_B), inv_B, num_groups, "amax")
    gap_G = torch.where(n_G > 1, max_G - second_G, 0.0)
    if norm_by_std:
        gap_G = gap_G / (std_G + eps)
    adv_B = torch.where(is_best_B, gap_G[inv_B], 0.0)
    adv_BT = _broadcast(adv_B, mask_BT)
    return adv_BT, adv_BT


@torch.no_grad()
def rloo(scores_B: Tensor, mask_BT: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor]:
    """RLOO: leave-one-out baseline, adv_i = s_i - mean_{j != i} s_j.

    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
    in LLMs", arXiv 2402.14740 (after Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!").
    verl: `compute_rloo_outcome_advantage`. A singleton group (no other sample) keeps its raw score; a group of two
    or more equal scores gets 0.

    Args:
        scores_B: (B,) outcome scores; mask_BT: (B, T); group_ids_B: (B,) integer ids in any order.

    Returns:
        `(advantages_BT, returns_BT)`, the same tensor twice, 0 at masked positions.
    """
    _check_B("scores_B", scores_B, mask_BT)
    s_B = _as_float(scores_B)
    inv_B, num_groups = _groups(group_ids_B, s_B.shape[0])
    n_G = _group_sum(torch.ones_like(s_B), inv_B, num_groups)
    sum_G = _group_sum(s_B, inv_B, num_groups)
    # A singleton's "others" sum to exactly 0 (its group sum is its score), so it keeps its score.
    others_mean_B = (sum_G[inv_B] - s_B) / (n_G[inv_B] - 1).clamp(min=1)
    adv_B = torch.where(_degenerate(s_B, inv_B, num_groups, n_G), 0.0, s_B - others_mean_B)
    adv_BT = _broadcast(adv_B, mask_BT)
    return adv_BT, adv_BT


@torch.no_grad()
def reinforce_pp_baseline(
    scores_B: Tensor, mask_BT: Tensor, group_ids_B: Tensor, *, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: subtract the group mean score, broadcast to tokens, whiten over the batch.

    Hu 2025, "REINFORCE++", arXiv 2501.03262 (the variant with a group baseline, for multi-sample prompts).
    verl: `compute_reinforce_plus_plus_baseline_outcome_advantage`. A singleton group's mean is 0, so its centred
    score is its raw score; all-equal groups centre to 0; whitening then shifts every token by the batch mean.

    Args:
        scores_B: (B,) outcome scores; mask_BT: (B, T); group_ids_B: (B,) integer ids in any order.
        eps: added to the batch variance when whitening (verl's `masked_whiten`: 1e-8).

    Returns:
        `(advantages_BT, returns_BT)`, the same tensor twice, 0 at masked positions. Whitening uses this batch's
        valid tokens; for global whitening use `grpo_outcome(..., norm_by_std=False)` and `masked_whiten` with
        all-reduced `masked_moments`.
    """
    centred_BT, _ = grpo_outcome(scores_B, mask_BT, group_ids_B, norm_by_std=False)
    adv_BT = masked_whiten(centred_BT, mask_BT, eps=eps)
    return adv_BT, adv_BT


@torch.no_grad()
def remax(token_rewards_BT: Tensor, baseline_scores_B: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax: the reward-to-go at every token minus the score of the greedy response to the same prompt.

    Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large
    Language Models", arXiv 2310.10505; verl's `compute_remax_outcome_advantage`:
        G_t = sum over valid tokens t' >= t of r_t',   A_t = G_t - b,
    where r are the per-token rewards (the score on the last valid token, minus a per-token KL penalty when KL is in
    the reward) and b the greedy response's score. Rewards at masked positions (padding, tool tokens) never count,
    and both outputs are 0 there (verl leaves the reward-to-go at a tool-token hole non-zero; it never reaches a
    loss). The caller generates the greedy rollout and scores it.

    Args:
        token_rewards_BT: (B, T) per-token rewards.
        baseline_scores_B: (B,) score of the greedy response for each row's prompt.
        mask_BT: (B, T) response mask.

    Returns:
        `(advantages_BT, returns_BT)`: A and G, both 0 at masked positions.
    """
    _check_BT("token_rewards_BT", token_rewards_BT, mask_BT)
    _check_B("baseline_scores_B", baseline_scores_B, mask_BT)
    valid_BT = mask_BT > 0
    rewards_BT = torch.where(valid_BT, _as_float(token_rewards_BT), 0.0)
    returns_BT = torch.where(valid_BT, rewards_BT.flip(-1).cumsum(-1).flip(-1), 0.0)
    baseline_B1 = _as_float(baseline_scores_B).to(returns_BT.dtype).unsqueeze(-1)
    adv_BT = torch.where(valid_BT, returns_BT - baseline_B1, 0.0)
    return adv_BT, returns_BT


@torch.no_grad()
def opo(scores_B: Tensor, mask_BT: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor]:
    """OPO: group baseline weighted by response length, b = Σ_j l_j s_j / Σ_j l_j.

    Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585: for sequence-level rewards the
    variance-optimal baseline weights each sample by its gradient norm, approximated by its length. `l_j` is the
    number of valid tokens of row j (tool tokens do not count). verl: `compute_opo_outcome_advantage`. A singleton
    group's baseline is 0 (it keeps its raw score); a group whose lengths are all 0 falls back to the plain mean
    (verl divides 0 by 0 there); a group of two or more equal scores gets 0.

    Args:
        scores_B: (B,) outcome scores; mask_BT: (B, T); group_ids_B: (B,) integer ids in any order.

    Returns:
        `(advantages_BT, returns_BT)`, the same tensor twice, 0 at masked positions.
    """
    _check_B("scores_B", scores_B, mask_BT)
    s_B = _as_float(scores_B)
    inv_B, num_groups = _groups(group_ids_B, s_B.shape[0])
    len_B = (mask_BT > 0).sum(dim=-1).to(s_B.dtype)
    weighted_G = _group_sum(len_B * s_B, inv_B, num_groups)
    total_len_G = _group_sum(len_B, inv_B, num_groups)
    n_G, mean_G, _ = _group_stats(s_B, inv_B, num_groups)
    baseline_G = torch.where(total_len_G > 0, weighted_G / total_len_G.clamp(min=1), mean_G)
    baseline_G = torch.where(n_G == 1, 0.0, baseline_G)
    adv_B = torch.where(_degenerate(s_B, inv_B, num_groups, n_G), 0.0, s_B - baseline_G[inv_B])
    adv_BT = _broadcast(adv_B, mask_BT)
    return adv_BT, adv_BT


def gpg_alpha(*, num_rows: int | float, num_nonzero_scores: int | float) -> float:
    """GPG's scaling factor as verl computes it: alpha = B / max(1, number of non-zero scores).

    Pass counts summed over DP ranks for a global alpha (`AdvantageStage` does one all-reduce).
    """
    return float(num_rows) / max(1.0, float(num_nonzero_scores))


@torch.no_grad()
def gpg(
    scores_B: Tensor,
    mask_BT: Tensor,
    group_ids_B: Tensor,
    *,
    norm_by_std: bool = False,
    eps: float = 1e-6,
    alpha: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GPG (Group Policy Gradient): group-mean baseline scaled by alpha.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv 2504.02546:  A_i = alpha * (s_i - mean_group) / F_norm. alpha follows verl's
    `compute_gpg_outcome_advantage`: B / max(1, number of rows with a non-zero score) (`gpg_alpha`), which for 0/1
    rewards divides the gradient by the share of correct samples; the paper writes B / (B - M) with M the rows of
    zero-advantage groups. F_norm = 1 by default (verl's and the paper's best setting); `norm_by_std=True` uses the
    group's unbiased std + eps. A singleton group's mean is 0 (it keeps alpha * score, as in verl); a group of two or
    more equal scores gets 0. Pair with `gpg_loss`.

    alpha is computed over the rows given here. When advantages are computed per DP rank, sum B and the non-zero
    count over the ranks and pass `alpha=gpg_alpha(...)` of the totals.

    Args:
        scores_B: (B,) outcome scores; mask_BT: (B, T); group_ids_B: (B,) integer ids in any order.
        norm_by_std: F_norm = group std + eps instead of 1.
        eps: added to the std.
        alpha: override for the scaling factor.

    Returns:
        `(advantages_BT, returns_BT)`, the same tensor twice, 0 at masked positions.
    """
    _check_B("scores_B", scores_B, mask_BT)
    s_B = _as_float(scores_B)
    B = s_B.shape[0]
    inv_B, num_groups = _groups(group_ids_B, B)
    adv_B = _group_normalise(s_B, inv_B, num_groups, norm_by_std=norm_by_std, eps=eps)
    if alpha is None:
        alpha = gpg_alpha(num_rows=B, num_nonzero_scores=int(torch.count_nonzero(s_B)))
    adv_BT = _broadcast(alpha * adv_B, mask_BT)
    return adv_BT, adv_BT


@torch.no_grad()
def gdpo_combine(
    components_BK: Tensor,
    mask_BT: Tensor,
    group_ids_B: Tensor,
    *,
    weights_K: Tensor | list[float] | tuple[float, ...] | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GDPO before its batch whitening: Σ_k w_k * GRPO-normalised component k, broadcast to the valid tokens.

    See `gdpo`. Each column of `components_BK` is group-normalised on its own exactly as `grpo_outcome` does
    (same singleton and all-equal rules), then the columns are summed with `weights_K`.

    Returns:
        (B, T) combined advantage, 0 at masked positions, not yet whitened.
    """
    if components_BK.dim() != 2 or components_BK.shape[0] != mask_BT.shape[0] or components_BK.shape[1] == 0:
        raise ValueError(
            f"components_BK must have shape ({mask_BT.shape[0]}, K) with K >= 1 to match mask_BT "
            f"{tuple(mask_BT.shape)}, got {tuple(components_BK.shape)}"
        )
    c_BK = _as_float(components_BK)
    K = c_BK.shape[1]
    w_K = (
        torch.ones(K, dtype=c_BK.dtype, device=c_BK.device)
        if weights_K is None
        else torch.as_tensor(weights_K, dtype=c_BK.dtype, device=c_BK.device)
    )
    if w_K.shape != (K,):
        raise ValueError(f"weights_K has {w_K.numel()} entries but components_BK has {K} reward components")
    inv_B, num_groups = _groups(group_ids_B, c_BK.shape[0])
    combined_B = torch.zeros(c_BK.shape[0], dtype=c_BK.dtype, device=c_BK.device)
    for k in range(K):
        combined_B += w_K[k] * _group_normalise(c_BK[:, k], inv_B, num_groups, norm_by_std=norm_by_std, eps=eps)
    return _broadcast(combined_B, mask_BT)


@torch.no_grad()
def gdpo(
    components_BK: Tensor,
    mask_BT: Tensor,
    group_ids_B: Tensor,
    *,
    weights_K: Tensor | list[float] | tuple[float, ...] | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GDPO: several reward components, each group-normalised, then weighted, summed and whitened over the batch.

    Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
    Optimization", arXiv 2601.05242. With K rewards r_k per sample (correctness, format, length, ...):
        A_k,i = (r_k,i - mean_group(r_k)) / (std_group(r_k) + eps)        (GRPO on each reward alone)
        S_i   = Σ_k w_k A_k,i
        A_i,t = whiten(S) over the valid tokens of the batch                 (as the authors' verl-GDPO does)
    Normalising each reward in its group before summing keeps combinations that GRPO on the summed reward would
    collapse to the same advantage apart; the final whitening keeps the scale independent of K.

    Args:
        components_BK: (B, K) one column per reward component, the same K and order on every rank.
        mask_BT: (B, T) response mask.
        group_ids_B: (B,) integer prompt id per row, any order.
        weights_K: (K,) weight of each component; default all 1.
        norm_by_std: divide each component by its group std (False: Dr.GRPO-style centring only).
        eps: added to each group std.

    Returns:
        `(advantages_BT, returns_BT)`, the same tensor twice, 0 at masked positions. Whitened over THIS batch's
        valid tokens (eps 1e-8 on the variance); across DP ranks whiten `gdpo_combine` with all-reduced
        `masked_moments` instead (`AdvantageStage` does).
    """
    adv_BT = masked_whiten(
        gdpo_combine(components_BK, mask_BT, group_ids_B, weights_K=weights_K, norm_by_std=norm_by_std, eps=eps),
        mask_BT,
    )
    return adv_BT, adv_BT
