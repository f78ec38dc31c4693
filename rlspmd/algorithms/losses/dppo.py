"""DPPO: PPO's trust region as a divergence bound on each sampled token's probability instead of a ratio clip.

Rethinking the Trust Region in LLM Reinforcement Learning, arXiv 2602.04879; verl: ``compute_policy_loss_dppo_tv`` and
``compute_policy_loss_dppo_kl``. Both are REINFORCE weighted by the (stop-gradient) ratio truncated at
``clip_ratio_c`` (truncated importance sampling instead of PPO's dual clip), with a token's gradient removed where the
update already moved its probability too far in the direction its advantage pushes:

    loss_t = -A_t * sg(min(r_t, clip_ratio_c)) * logp_t * valid_t,

so d loss_t / d logp_t = -A_t min(r_t, c) valid_t (PPO's -A r where nothing binds). With p = pi_theta(y_t), q =
pi_old(y_t):

* binary TV (``dppo_tv``): valid where p - q <= clip_high for A > 0, and p - q >= -clip_low for A <= 0;
* binary KL (``dppo_kl``): the KL of the two-outcome distributions (y_t or not), D = q log(q/p) + (1-q)
  log((1-q+1e-8)/(1-p+1e-8)); valid where D <= clip_high or p <= q for A > 0, and D <= clip_low or p >= q for A <= 0.

The bounds are on the divergence, not the ratio (verl's recipes: 0.15 for TV, 0.05 for KL). The loss value carries
logp, as CISPO's does, so it is not comparable across losses. Shapes and conventions:
``rlspmd.algorithms.losses.common``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from rlspmd.algorithms.aggregation import AggArgs
from rlspmd.algorithms.losses.common import (
    PolicyLoss,
    Problem,
    clip_metrics,
    common_metrics,
    log_ratio,
    masked_mean,
    prepare,
    prepare_weights,
    weighted,
)


def _dppo(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    divergence: str,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
    weights_BT: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)
    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    truncated_BT = ratio_BT.clamp(max=clip_ratio_c).detach()

    lp, old = logprobs_BT.detach(), old_logprobs_BT
    p, q = lp.exp(), old.exp()
    if divergence == "tv":
        inside_BT = torch.where(adv_BT > 0, p - q <= clip_high, p - q >= -clip_low)
    else:
        binary_kl = q * (old - lp) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        inside_BT = torch.where(adv_BT > 0, (binary_kl <= clip_high) | (p <= q), (binary_kl <= clip_low) | (p >= q))

    loss_BT = -adv_BT * truncated_BT * logprobs_BT * inside_BT.to(logprobs_BT.dtype)
    metrics = clip_metrics(~inside_BT, adv_BT, valid_BT)
    # verl's pg_clipfrac_lower for DPPO: tokens that count whose weight the truncation at clip_ratio_c cut
    metrics["truncated_frac"] = masked_mean(((ratio_BT.detach() > clip_ratio_c) & inside_BT).float(), valid_BT)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(weighted(loss_BT, w_BT), mask_BT), metrics


def dppo_tv(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    clip_low: float = 0.15,
    clip_high: float = 0.15,
    clip_ratio_c: float = 20.0,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO with the binary total-variation bound (module docstring; verl: ``dppo_tv``).

    Returns:
        `(loss, metrics)`: metrics `clip_frac` (valid tokens outside the bound: no gradient), `clip_frac_upper` /
        `clip_frac_lower` (those with A > 0 / A < 0), `truncated_frac` (tokens inside whose ratio exceeded
        `clip_ratio_c`), `approx_kl`, `ratio_mean`.
    """
    return _dppo(
        logprobs_BT,
        old_logprobs_BT,
        advantages_BT,
        mask_BT,
        agg=agg,
        divergence="tv",
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        weights_BT=weights_BT,
    )


def dppo_kl(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    clip_low: float = 0.05,
    clip_high: float = 0.05,
    clip_ratio_c: float = 20.0,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO with the binary KL bound (module docstring; verl: ``dppo_kl``). Metrics as ``dppo_tv``'s."""
    return _dppo(
        logprobs_BT,
        old_logprobs_BT,
        advantages_BT,
        mask_BT,
        agg=agg,
        divergence="kl",
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        weights_BT=weights_BT,
    )


def _dppo_problems(low: float, high: float, c: float) -> list[Problem]:
    out = [(n, v, "must be >= 0") for n, v in (("clip_divergence_low", low), ("clip_divergence_high", high)) if v < 0]
    return out + ([] if c >= 1 else [("clip_ratio_c", c, "the truncation of the ratio must be >= 1")])


@dataclass
class DPPOTV(PolicyLoss):
    """DPPO-Binary-TV: a token loses its gradient once |pi - pi_old| of its sampled token passes the bound in the
    direction of its advantage; the ratio weight is truncated at ``clip_ratio_c`` (verl: ``dppo_tv``)."""

    name: ClassVar[str] = "dppo_tv"
    clip_divergence_low: float = 0.15
    """Bound on pi_old - pi for tokens with A <= 0 (a probability difference, >= 0)."""
    clip_divergence_high: float = 0.15
    """Bound on pi - pi_old for tokens with A > 0 (>= 0)."""
    clip_ratio_c: float = 20.0
    """Truncation of the stop-gradient ratio weight (>= 1)."""

    def problems(self) -> list[Problem]:
        return _dppo_problems(self.clip_divergence_low, self.clip_divergence_high, self.clip_ratio_c)

    def build(self, *, generator=None):
        return partial(
            dppo_tv,
            clip_low=self.clip_divergence_low,
            clip_high=self.clip_divergence_high,
            clip_ratio_c=self.clip_ratio_c,
        )


@dataclass
class DPPOKL(PolicyLoss):
    """DPPO-Binary-KL: a token loses its gradient once the KL between the two-outcome distributions (sampled token or
    not) under pi_old and pi passes the bound in the direction of its advantage (verl: ``dppo_kl``)."""

    name: ClassVar[str] = "dppo_kl"
    clip_divergence_low: float = 0.05
    """Bound on the binary KL for tokens with A <= 0 whose probability fell (>= 0)."""
    clip_divergence_high: float = 0.05
    """Bound on the binary KL for tokens with A > 0 whose probability rose (>= 0)."""
    clip_ratio_c: float = 20.0
    """Truncation of the stop-gradient ratio weight (>= 1)."""

    def problems(self) -> list[Problem]:
        return _dppo_problems(self.clip_divergence_low, self.clip_divergence_high, self.clip_ratio_c)

    def build(self, *, generator=None):
        return partial(
            dppo_kl,
            clip_low=self.clip_divergence_low,
            clip_high=self.clip_divergence_high,
            clip_ratio_c=self.clip_ratio_c,
        )
