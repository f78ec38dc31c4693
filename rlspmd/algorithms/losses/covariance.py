"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"): PPO's loss with the
gradient of a few high-covariance tokens removed, or a KL penalty on them. Both select tokens from statistics of the
micro-batch they are given, as verl's and the paper's code do (``micro_batch_local``). Shapes and conventions:
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
    fraction_problems,
    PolicyLoss,
    Problem,
)


def _centred_covariance(adv_BT: Tensor, logprobs_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """Per-token (A_t - mean A) (logp_t - mean logp), means over this micro-batch's valid tokens (no gradient)."""
    logprobs_BT = logprobs_BT.detach()
    return (adv_BT - masked_mean(adv_BT, valid_BT)) * (logprobs_BT - masked_mean(logprobs_BT, valid_BT))


def clip_cov(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights_BT: Tensor | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO's clipped surrogate, plus the gradient of a few high-covariance tokens removed.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv 2505.22617; verl: `compute_policy_loss_clip_cov`. Entropy falls when the policy raises tokens that are
    both likely and advantageous; the covariance cov_t = (A_t - mean A)(logp_t - mean logp) measures that. Among the
    valid tokens that PPO did not clip and whose cov_t lies strictly inside (clip_cov_lb, clip_cov_ub),
    max(1, int(clip_cov_ratio * valid tokens)) are drawn at random (uniformly, with `generator`; all of them when
    fewer qualify) and their loss is set to 0, so they get no gradient:
        loss_t = 0 for a drawn token,  max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) otherwise.
    No dual clip, as in verl. The means and the token count are over the micro-batch
    given (as in verl and the paper's code), so the result depends on the micro-batching (`micro_batch_local`).

    Returns:
        `(loss, metrics)`: metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower` (PPO's clip), `cov_clip_frac`
        (fraction of valid tokens drawn: verl's `pg_clipfrac` for this loss), `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    surrogate_BT, clipped_BT = ppo_surrogate(adv_BT, ratio_BT, clip_low, clip_high)
    cov_BT = _centred_covariance(adv_BT, logprobs_BT, valid_BT)
    eligible_BT = valid_BT & ~clipped_BT & (cov_BT > clip_cov_lb) & (cov_BT < clip_cov_ub)
    candidates = eligible_BT.flatten().nonzero().squeeze(-1)
    budget = max(int(clip_cov_ratio * int(valid_BT.sum())), 1)
    if candidates.numel() > budget:
        draw = torch.randperm(
            candidates.numel(), generator=generator, device=generator.device if generator is not None else "cpu"
        )[:budget]
        candidates = candidates[draw.to(candidates.device)]
    drawn_BT = torch.zeros_like(valid_BT).flatten().index_fill_(0, candidates, True).view_as(valid_BT)
    loss_BT = torch.where(drawn_BT, 0.0, surrogate_BT)

    metrics = clip_metrics(clipped_BT, adv_BT, valid_BT)
    metrics["cov_clip_frac"] = masked_mean(drawn_BT.float(), valid_BT)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class ClipCov(PolicyLoss):
    """Clip-Cov: PPO's clipped loss with the gradient of a few high-covariance tokens removed, drawn per
    micro-batch (so its gradient depends on the micro-batching)."""

    name: ClassVar[str] = "clip_cov"
    micro_batch_local: ClassVar[bool] = True
    clip_ratio_low: float = 0.2
    """PPO ratio lower clip."""
    clip_ratio_high: float = 0.2
    """PPO ratio upper clip."""
    clip_cov_ratio: float = 2e-4
    """Fraction of a micro-batch's valid tokens, drawn at random among those whose advantage-logprob covariance lies in
    (``clip_cov_lb``, ``clip_cov_ub``), whose gradient is removed (at least one token). In (0, 1]."""
    clip_cov_lb: float = 1.0
    """Lower bound of the covariance band that can be drawn."""
    clip_cov_ub: float = 5.0
    """Upper bound of the covariance band that can be drawn (> ``clip_cov_lb``)."""

    def problems(self) -> list[Problem]:
        band = (
            []
            if self.clip_cov_lb < self.clip_cov_ub
            else [("clip_cov_lb", self.clip_cov_lb, f"must be < clip_cov_ub={self.clip_cov_ub}")]
        )
        return (
            clip_problems(self.clip_ratio_low, self.clip_ratio_high)
            + fraction_problems("clip_cov_ratio", self.clip_cov_ratio)
            + band
        )

    def build(self, *, generator=None):
        """``generator``: the seeded draws of the tokens (per rank)."""
        return partial(
            clip_cov,
            clip_low=self.clip_ratio_low,
            clip_high=self.clip_ratio_high,
            clip_cov_ratio=self.clip_cov_ratio,
            clip_cov_lb=self.clip_cov_lb,
            clip_cov_ub=self.clip_cov_ub,
            generator=generator,
        )


def kl_cov(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    weights_BT: Tensor | None = None,
    kl_cov_ratio: float = 2e-4,
    kl_cov_coef: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: the unclipped policy-gradient surrogate, plus a KL penalty on the highest-covariance tokens.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv 2505.22617; verl: `compute_policy_loss_kl_cov`. With cov_t = (A_t - mean A)(logp_t - mean logp) over the
    valid tokens, the k = max(1, int(kl_cov_ratio * valid tokens)) tokens of largest cov_t get
        loss_t = -A_t r_t + kl_cov_coef * |logp_t - old_t|,
    every other token loss_t = -A_t r_t (no clip: the penalty is the trust region, and only where entropy would
    collapse). The means and k are over the micro-batch given (as in verl and the paper's code), so the result
    depends on the micro-batching (`micro_batch_local`). No clip. verl's default
    coefficient is 0.1; the paper's recipes use 1.0 with kl_cov_ratio 2e-3 (7B) or 2e-4 (32B).

    Returns:
        `(loss, metrics)`: metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower` (always 0), `kl_cov_frac`
        (fraction of valid tokens penalised), `abs_kl` (mean |logp - old|: verl's `ppo_kl` for this loss),
        `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    abs_kl_BT = (logprobs_BT - old_logprobs_BT).abs()
    cov_BT = _centred_covariance(adv_BT, logprobs_BT, valid_BT)
    valid_idx = valid_BT.flatten().nonzero().squeeze(-1)
    penalised_BT = torch.zeros_like(valid_BT)
    if valid_idx.numel() > 0:
        k = max(1, int(valid_idx.numel() * kl_cov_ratio))
        top = torch.topk(cov_BT.flatten()[valid_idx], k).indices
        penalised_BT = penalised_BT.flatten().index_fill_(0, valid_idx[top], True).view_as(valid_BT)
    loss_BT = -adv_BT * ratio_BT + torch.where(penalised_BT, kl_cov_coef * abs_kl_BT, 0.0)

    metrics = no_clip_metrics(loss_BT.device)
    metrics["kl_cov_frac"] = masked_mean(penalised_BT.float(), valid_BT)
    metrics["abs_kl"] = masked_mean(abs_kl_BT.detach(), valid_BT)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class KLCov(PolicyLoss):
    """KL-Cov: the unclipped policy gradient plus a KL penalty on the tokens of largest advantage-logprob covariance,
    chosen per micro-batch (so its gradient depends on the micro-batching)."""

    name: ClassVar[str] = "kl_cov"
    micro_batch_local: ClassVar[bool] = True
    kl_cov_ratio: float = 2e-4
    """Fraction of a micro-batch's valid tokens, those of largest covariance, that get the penalty
    ``kl_cov_coef * |logp - old_logp|`` (at least one token). In (0, 1]. The paper's recipes: 2e-3 for 7B models,
    2e-4 for 32B."""
    kl_cov_coef: float = 0.1
    """Coefficient of the penalty on the selected tokens (verl's ``ppo_kl_coef``; the paper's recipes use 1.0)."""

    def problems(self) -> list[Problem]:
        coef = [] if self.kl_cov_coef >= 0 else [("kl_cov_coef", self.kl_cov_coef, "must be >= 0")]
        return fraction_problems("kl_cov_ratio", self.kl_cov_ratio) + coef

    def build(self, *, generator=None):
        return partial(kl_cov, kl_cov_ratio=self.kl_cov_ratio, kl_cov_coef=self.kl_cov_coef)
