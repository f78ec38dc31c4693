"""Sequence-level policy losses: GSPO's sequence ratio, SAPO's smooth gate and GMPO's geometric mean. Each
aggregates ``seq-mean-token-mean`` whatever ``agg.mode`` says, as verl's ``compute_policy_loss_gspo`` / ``_sapo`` /
``_geo_mean`` do (``per_sequence``). Shapes and conventions: ``rlspmd.algorithms.losses.common``."""

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
    seq_mean_token_mean,
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

_GSPO_LOG_RATIO_MAX = 10.0  # verl's compute_policy_loss_gspo clamps the sequence log-ratio from above at 10


def gspo(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: a sequence-level importance ratio, clipped per sequence.

    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071; verl: `compute_policy_loss_gspo`.
    The sequence ratio is the geometric mean of the token ratios, s_i = exp(mean over valid tokens of
    (logp - old)). This is the paper's GSPO-token form: s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], equal to s_i in
    value with d s_{i,t} / d logp_t = s_i; its log is clamped from above at 10 (as verl does; the gradient is 0
    where that acts), and
        loss_t = max(-A_t s_{i,t}, -A_t clip(s_{i,t}, 1 - clip_low, 1 + clip_high)).
    Aggregated `seq-mean-token-mean` whatever `agg.mode` says (verl's choice; with a sequence-level advantage this
    is exactly GSPO's gradient). Clipping acts on whole sequences; the paper's range is tiny (clip_low=3e-4,
    clip_high=4e-4): the caller sets it. GSPO has no dual clip.

    Returns:
        `(loss, metrics)`: metrics `clip_frac` (fraction of valid tokens in clipped sequences), `clip_frac_upper`,
        `clip_frac_lower`, `seq_ratio_mean`, `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)
    m_BT = valid_BT.to(logprobs_BT.dtype)

    n_B = m_BT.sum(dim=-1).clamp(min=1)
    log_seq_ratio_B = ((logprobs_BT.detach() - old_logprobs_BT) * m_BT).sum(dim=-1) / n_B
    log_seq_ratio_BT = log_seq_ratio_B.unsqueeze(-1) + logprobs_BT - logprobs_BT.detach()
    log_seq_ratio_BT = log_seq_ratio_BT.clamp(max=_GSPO_LOG_RATIO_MAX)
    seq_ratio_BT = log_seq_ratio_BT.exp()
    loss_BT, clipped_BT = ppo_surrogate(adv_BT, seq_ratio_BT, clip_low, clip_high)

    token_ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    metrics = clip_metrics(clipped_BT, adv_BT, valid_BT)
    metrics["seq_ratio_mean"] = masked_mean(seq_ratio_BT.detach(), valid_BT)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, token_ratio_BT, valid_BT)
    return seq_mean_token_mean(agg)(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class GSPO(PolicyLoss):
    """GSPO: a sequence-level ratio (the geometric mean of the token ratios), whole sequences clipped; aggregates
    ``seq-mean-token-mean`` whatever ``actor.loss_agg_mode`` says, as verl does."""

    name: ClassVar[str] = "gspo"
    per_sequence: ClassVar[bool] = True
    clip_ratio_low: float = 3e-4
    """Sequence-ratio lower clip (the paper's 3e-4)."""
    clip_ratio_high: float = 4e-4
    """Sequence-ratio upper clip (the paper's 4e-4)."""

    def problems(self) -> list[Problem]:
        return clip_problems(self.clip_ratio_low, self.clip_ratio_high)

    def build(self, *, generator=None):
        return partial(gspo, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high)


def sapo(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    agg: AggArgs,
    weights_BT: Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a smooth, temperature-controlled gate on the ratio instead of a hard clip.

    Gao et al. 2025 (Qwen), "Soft Adaptive Policy Optimization", arXiv 2511.20347; verl: `compute_policy_loss_sapo`:
        f(r) = sigmoid(tau (r - 1)) * 4 / tau,   loss_t = -f(r_t) A_t,
    with tau = tau_pos where A_t > 0 and tau_neg otherwise (the paper's defaults 1.0 and 1.05: negative
    advantages, which push up many unsampled tokens, are damped faster). d loss_t / d logp_t
    = -A_t r_t * 4 sigmoid(x)(1 - sigmoid(x)), x = tau (r_t - 1): exactly the unclipped policy gradient at r = 1,
    smoothly decaying as the ratio moves away on either side. Aggregated `seq-mean-token-mean` whatever `agg.mode`
    says (verl's choice). No clip. Temperatures must be > 0.

    Returns:
        `(loss, metrics)`: metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower` (always 0: nothing is
        hard-clipped), `soft_gate_weight` (mean of 4 sigmoid(x)(1 - sigmoid(x)), the factor on the vanilla
        gradient), `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT).exp()
    tau_BT = torch.where(adv_BT > 0, tau_pos, tau_neg).to(ratio_BT.dtype)
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
    loss_BT = -(gate_BT * 4.0 / tau_BT) * adv_BT

    gate_BT = gate_BT.detach()
    metrics = no_clip_metrics(loss_BT.device)
    metrics["soft_gate_weight"] = masked_mean(4.0 * gate_BT * (1.0 - gate_BT), valid_BT)
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return seq_mean_token_mean(agg)(weighted(loss_BT, w_BT), mask_BT), metrics


@dataclass
class SAPO(PolicyLoss):
    """SAPO: a smooth, temperature-controlled gate on the ratio instead of a hard clip; aggregates
    ``seq-mean-token-mean``."""

    name: ClassVar[str] = "sapo"
    per_sequence: ClassVar[bool] = True
    tau_pos: float = 1.0
    """Gate temperature for tokens with a positive advantage (> 0)."""
    tau_neg: float = 1.05
    """Gate temperature for tokens with a non-positive advantage (> 0)."""

    def problems(self) -> list[Problem]:
        taus = (("tau_pos", self.tau_pos), ("tau_neg", self.tau_neg))
        return [(name, tau, "must be > 0") for name, tau in taus if not tau > 0]

    def build(self, *, generator=None):
        return partial(sapo, tau_pos=self.tau_pos, tau_neg=self.tau_neg)


def gmpo(
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
    """GMPO: maximise the geometric mean of the clipped token ratios, one objective per sequence.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673; verl: `compute_policy_loss_geo_mean`:
        J_i = sgn(A_i) * (prod_t |min(r_t A_i, clip(r_t, e^-clip_low, e^clip_high) A_i)|)^(1/|o_i|),
    computed in log space: with l_t = logp_t - old_t and c_t = clip(l_t, -clip_low, clip_high), each token keeps
    min(l_t, c_t) when A_i > 0 and max(l_t, c_t) when A_i < 0 (PPO's pessimistic choice), and
        loss_i = -A_i * exp(mean over valid tokens of the kept log-ratios).
    `clip_low` / `clip_high` are therefore LOG-space bounds here; the paper uses 0.4 for both, i.e. ratios in
    (e^-0.4, e^0.4), wider than PPO's because the geometric mean is far less sensitive to single outliers.
    A token whose ratio was clipped gets no gradient. No dual clip.

    GMPO is defined for a sequence-level advantage: A_i is taken as the mean of `advantages_BT` over the row's
    valid tokens (exact for outcome estimators). The loss is the mean of loss_i over the sequences (the paper's
    1/G sum; verl's `torch.mean` over sequences), with `agg`'s global sequence count, whatever `agg.mode` says.
    With `weights_BT`, loss_i is multiplied by the geometric mean of row i's token weights (verl).

    Returns:
        `(loss, metrics)`: metrics `clip_frac` (fraction of valid tokens whose gradient the clip removed),
        `clip_frac_upper` / `clip_frac_lower` (valid tokens with A > 0 / A < 0 whose log-ratio lies outside
        [-clip_low, clip_high]: verl's `pg_clipfrac` / `pg_clipfrac_lower`), `seq_ratio_mean`, `approx_kl`,
        `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)
    m_BT = valid_BT.to(logprobs_BT.dtype)

    n_B = m_BT.sum(dim=-1).clamp(min=1)
    seq_adv_B = (adv_BT * m_BT).sum(dim=-1) / n_B
    sign_B1 = torch.sign(seq_adv_B).unsqueeze(-1)
    log_ratio_BT = log_ratio(logprobs_BT, old_logprobs_BT)
    clipped_log_ratio_BT = log_ratio_BT.clamp(-clip_low, clip_high)
    kept_BT = sign_B1 * torch.minimum(sign_B1 * log_ratio_BT, sign_B1 * clipped_log_ratio_BT)
    seq_ratio_B = ((kept_BT * m_BT).sum(dim=-1) / n_B).exp()
    loss_B = -seq_adv_B * seq_ratio_B
    if w_BT is not None:
        # log of 1 is exactly 0 and exp(0) exactly 1, so all-ones weights leave loss_B untouched.
        tiny = torch.finfo(w_BT.dtype).tiny
        loss_B = loss_B * ((w_BT.clamp(min=tiny).log() * m_BT).sum(dim=-1) / n_B).exp()
    loss_BT = loss_B.unsqueeze(-1).expand_as(logprobs_BT)

    log_ratio_BT = log_ratio_BT.detach()
    cut_BT = ((sign_B1 > 0) & (log_ratio_BT > clip_high)) | ((sign_B1 < 0) & (log_ratio_BT < -clip_low))
    outside_BT = (log_ratio_BT > clip_high) | (log_ratio_BT < -clip_low)
    metrics = {
        "clip_frac": masked_mean(cut_BT.float(), valid_BT),
        "clip_frac_upper": masked_mean((outside_BT & (adv_BT > 0)).float(), valid_BT),
        "clip_frac_lower": masked_mean((outside_BT & (adv_BT < 0)).float(), valid_BT),
        "seq_ratio_mean": masked_mean(seq_ratio_B.detach().unsqueeze(-1).expand_as(m_BT), valid_BT),
    }
    metrics |= common_metrics(logprobs_BT, old_logprobs_BT, log_ratio_BT.exp(), valid_BT)
    return seq_mean_token_mean(agg)(loss_BT, mask_BT), metrics


@dataclass
class GMPO(PolicyLoss):
    """GMPO: the geometric mean of the clipped token ratios, one objective per sequence; aggregates
    ``seq-mean-token-mean``."""

    name: ClassVar[str] = "gmpo"
    per_sequence: ClassVar[bool] = True
    clip_ratio_low: float = 0.2
    """Log-ratio lower clip (the clip acts on log r in [-clip_ratio_low, clip_ratio_high])."""
    clip_ratio_high: float = 0.2
    """Log-ratio upper clip."""

    def problems(self) -> list[Problem]:
        return clip_problems(self.clip_ratio_low, self.clip_ratio_high)

    def build(self, *, generator=None):
        return partial(gmpo, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high)
