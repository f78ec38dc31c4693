"""Token-level policy gradients: PPO's clipped surrogate (with dual clip), CISPO's clipped-weight REINFORCE, GPG's
plain policy gradient and DRO's policy gradient with a quadratic penalty on the log-ratio. Shapes and conventions:
``rlspmd.algorithms.losses.common``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from rlspmd.algorithms.aggregation import AggArgs
from rlspmd.algorithms.losses.common import (
    prepare_weights,
    prepare,
    weighted,
    masked_mean,
    log_ratio,
    common_metrics,
    clip_metrics,
    no_clip_metrics,
    ppo_surrogate,
    clip_problems,
    PolicyLoss,
    Problem,
)


def ppo_clip(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347:
        loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    An asymmetric range (clip_high > clip_low) is DAPO's "clip-higher" (Yu et al. 2025, arXiv 2503.14476).
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning",
    arXiv 1912.09729): for A < 0 the loss is further capped at -A * clip_ratio_c, so a token whose ratio exploded
    cannot dominate the batch; `clip_ratio_c=None` disables it (it must be > 1 otherwise). verl:
    `compute_policy_loss_vanilla`.

    Gradient w.r.t. logp_t (before aggregation): -A r when unclipped; 0 when clipped (A > 0 and r > 1 + clip_high,
    or A < 0 and r < 1 - clip_low) and when dual-clipped (A < 0 and r > clip_ratio_c).

    Returns:
        `(loss, metrics)`: loss aggregated with `agg`; metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower`,
        `dual_clip_frac`, `approx_kl`, `ratio_mean` (see the module docstring).
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    loss_BT, clipped_BT = ppo_surrogate(adv_BT, ratio_BT, clip_low, clip_high)
    metrics = clip_metrics(clipped_BT, adv_BT, valid_BT)

    if clip_ratio_c is None:
        metrics["dual_clip_frac"] = torch.zeros((), device=loss_BT.device)
    else:
        cap_BT = -adv_BT * clip_ratio_c
        negative_BT = adv_BT < 0
        metrics["dual_clip_frac"] = masked_mean((negative_BT & (loss_BT > cap_BT)).float(), valid_BT)
        loss_BT = torch.where(negative_BT, torch.minimum(loss_BT, cap_BT), loss_BT)

    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class PPOClip(PolicyLoss):
    """PPO's clipped surrogate with an asymmetric clip range and dual clip (verl: ``vanilla``)."""

    name: ClassVar[str] = "ppo_clip"
    clip_ratio_low: float = 0.2
    """Ratio lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Ratio upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher raises it, e.g. 0.28)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound for negative advantages (> 1; None disables dual clip)."""

    def problems(self) -> list[Problem]:
        dual = (
            []
            if self.clip_ratio_c is None or self.clip_ratio_c > 1
            else [("clip_ratio_c", self.clip_ratio_c, "the dual-clip bound must be > 1, or None (off)")]
        )
        return clip_problems(self.clip_ratio_low, self.clip_ratio_high) + dual

    def build(self, *, generator=None):
        return partial(
            ppo_clip, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c
        )


def cispo(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio; no token is ever dropped.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585;
    verl: `compute_policy_loss_cispo`:
        loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t,
    so d loss_t / d logp_t = -clip(r_t) A_t. Unlike PPO, a clipped token still contributes its (truncated)
    gradient. The paper bounds only the top of the ratio (its lower bound is left off): pass clip_low >= 1 to do
    the same. No dual clip. The loss VALUE includes logp and so is not comparable across losses.

    Returns:
        `(loss, metrics)`: metrics `clip_frac` (fraction of valid tokens whose weight was truncated, either side),
        `clip_frac_upper` / `clip_frac_lower` (those with A > 0 / A < 0), `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    clip_weight_BT = ratio_BT.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = -clip_weight_BT * adv_BT * logprobs_BT

    truncated_BT = (ratio_BT < 1.0 - clip_low) | (ratio_BT > 1.0 + clip_high)
    metrics = clip_metrics(truncated_BT, adv_BT, valid_BT)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class CISPO(PolicyLoss):
    """CISPO: REINFORCE weighted by a clipped, stop-gradient ratio; no token is dropped."""

    name: ClassVar[str] = "cispo"
    clip_ratio_low: float = 0.2
    """The weight's lower bound: 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """The weight's upper bound: 1 + clip_ratio_high."""

    def problems(self) -> list[Problem]:
        return clip_problems(self.clip_ratio_low, self.clip_ratio_high)

    def build(self, *, generator=None):
        return partial(cispo, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high)


def gpg_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG's loss: plain policy gradient, loss_t = -A_t logp_t; no ratio, no clip.

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv 2504.02546 (the paper aggregates with `token-mean`); verl: `compute_policy_loss_gpg`. Pair with the `gpg`
    advantage estimator. On-policy by construction: `old_logprobs_BT` only feeds the metrics.

    Returns:
        `(loss, metrics)`: metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower` (always 0), `approx_kl`,
        `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    loss_BT = -adv_BT * logprobs_BT
    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    metrics = no_clip_metrics(loss_BT.device)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class GPG(PolicyLoss):
    """GPG's plain policy gradient, loss = -A logp (no ratio, no clip; no options). Pair with
    ``algorithm.adv_estimator=GPGAdvantage()`` (``algorithm.adv-estimator:gpg``)."""

    name: ClassVar[str] = "gpg"

    def build(self, *, generator=None):
        return gpg_loss


def dro(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    beta: float = 0.1,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO: the plain policy gradient with a quadratic penalty that keeps the update near the behaviour policy.

    Direct Reward Optimization (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language
    Models Alignment", arXiv 2405.19107); verl's ``dro`` loss:
        loss_t = -(logp_t A_t - 0.5 beta (logp_t - old_t)^2),
    so d loss_t / d logp_t = -A_t + beta (logp_t - old_t): no ratio, no clip; the penalty grows with the log-ratio
    (unclamped, as verl's). The loss VALUE includes logp and so is not comparable across losses.

    Returns:
        `(loss, metrics)`: metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower` (always 0), `log_ratio_sq` (mean
        of (logp - old)^2, the penalty's size before beta), `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    square_BT = (logprobs_BT - old_logprobs_BT).square()
    loss_BT = -(logprobs_BT * adv_BT - 0.5 * beta * square_BT)
    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    metrics = no_clip_metrics(loss_BT.device)
    metrics["log_ratio_sq"] = masked_mean(square_BT.detach(), valid_BT)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class DRO(PolicyLoss):
    """DRO: -(logp A - 0.5 beta (logp - old_logp)^2), the policy gradient with a quadratic pull to the behaviour policy
    (verl: ``dro``)."""

    name: ClassVar[str] = "dro"
    beta: float = 0.1
    """Weight of the quadratic log-ratio penalty (> 0)."""

    def problems(self) -> list[Problem]:
        return [] if self.beta > 0 else [("beta", self.beta, "must be > 0")]

    def build(self, *, generator=None):
        return partial(dro, beta=self.beta)
