"""Policy and value losses: pure functions from log-probabilities and advantages to a scalar loss and metrics.

Every policy loss has the same tensor arguments and its own keyword options:

    fn(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, weights_BT=None, <its options>) -> (loss, metrics)

The trainer gets one with its options bound from the loss's config component (``rlspmd.config.PPOClip``, ``GSPO``,
... ``build()``), which also checks the options (``problems()``, called by ``rlspmd.validate`` before anything
loads); the functions here assume valid options.

* `logprobs_BT` (B, T): log pi_theta of the sampled tokens, carrying gradient.
* `old_logprobs_BT` (B, T): log pi_old of the same tokens (the policy that generated them, or the actor before this
  update); `advantages_BT` (B, T). Both are treated as constants (detached).
* `mask_BT` (B, T): 1.0 for response tokens that count, 0.0 for padding and tool / observation tokens (and for the
  tokens a rollout correction rejected, see `rollout_correction.py`).
* `agg`: `AggArgs`, the aggregation mode and the global-batch denominators (see `aggregation.py`).
* `weights_BT` (B, T) or None: a per-token weight multiplied into the per-token loss before aggregation, as verl's
  `rollout_is_weights`: the truncated importance weights pi_train / pi_rollout of a rollout correction. Treated as
  a constant; ignored at masked positions; None and all-ones give bit-identical losses and gradients. GMPO, whose
  objective is per sequence, multiplies each sequence's loss by the geometric mean of its tokens' weights (verl).
* Options: `clip_low` / `clip_high` (>= 0) for the clipped losses, `clip_ratio_c` (> 1 or None) for `ppo_clip`,
  `tau_pos` / `tau_neg` (> 0) for SAPO, `clip_cov_*` and `generator` for Clip-Cov, `kl_cov_*` for KL-Cov.

Aggregation: GSPO, SAPO and GMPO aggregate with `seq-mean-token-mean` (the mean over sequences of token means, with
`agg`'s global sequence count) whatever `agg.mode` says, as verl's `compute_policy_loss_gspo` / `_sapo` /
`_geo_mean` do; the other losses use `agg` as given.

The ratio is exp(clamp(logp - old, -20, 20)) everywhere (the clamp keeps exp finite for wildly off-policy
tokens). Metrics are detached 0-dim tensors, plain masked means over THIS micro-batch (reduce them across ranks
for logging):
* `clip_frac`: fraction of valid tokens whose gradient a clip removed or truncated;
* `clip_frac_upper` / `clip_frac_lower`: the clipped tokens split by advantage sign (A > 0: the ratio hit the upper
  bound; A < 0: the lower), as verl's GMPO reports `pg_clipfrac` / `pg_clipfrac_lower`. For GMPO a token counts
  when its log-ratio lies outside the clip range (verl's definition), whether or not the pessimistic min kept it.
  Mapping to verl's names: ppo_clip, gspo, cispo: `pg_clipfrac` = `clip_frac`, `pg_clipfrac_lower` =
  `dual_clip_frac` (ppo_clip; 0 for the others); gmpo: `pg_clipfrac` = `clip_frac_upper`, `pg_clipfrac_lower` =
  `clip_frac_lower`; clip_cov: `pg_clipfrac` = `cov_clip_frac`;
* `approx_kl` (mean of old - new over valid tokens: the k1 estimate of KL(pi_old || pi_theta) on samples from
  pi_old, verl's `ppo_kl`) and `ratio_mean` (mean token ratio pi_theta / pi_old), plus loss-specific ones.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

from rlspmd.algorithms.aggregation import AggArgs

_LOG_RATIO_LIMIT = 20.0
_GSPO_LOG_RATIO_MAX = 10.0  # verl's compute_policy_loss_gspo clamps the sequence log-ratio from above at 10
MICRO_BATCH_LOCAL_LOSSES = frozenset({"clip_cov", "kl_cov"})
"""Losses whose token selection uses statistics of the micro-batch they are given (as verl's and the paper's code
do), so their gradient depends on how a mini-batch is split over ranks and micro-batches. Every other loss gives
the same gradient for any split."""


def _check_shapes(mask_BT: Tensor, **tensors_BT: Tensor) -> None:
    shape = tuple(mask_BT.shape)
    for name, x in tensors_BT.items():
        if tuple(x.shape) != shape or len(shape) != 2:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected the 2-D shape of mask_BT {shape}")


def _prepare(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Check shapes, make old log-probs and advantages constants, and zero all three at masked positions.

    Zeroing with `torch.where` (whose backward gives the unselected branch exactly 0) keeps a non-finite value at
    a padding position, e.g. a -inf log-prob, from reaching the loss or the gradient as NaN.
    """
    _check_shapes(mask_BT, logprobs_BT=logprobs_BT, old_logprobs_BT=old_logprobs_BT, advantages_BT=advantages_BT)
    valid_BT = mask_BT > 0
    logprobs_BT = torch.where(valid_BT, logprobs_BT, 0.0)
    old_logprobs_BT = torch.where(valid_BT, old_logprobs_BT.detach(), 0.0)
    advantages_BT = torch.where(valid_BT, advantages_BT.detach(), 0.0)
    return logprobs_BT, old_logprobs_BT, advantages_BT, valid_BT


def _prepare_weights(weights_BT: Tensor | None, valid_BT: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The per-token weights as a constant of the loss's dtype, 1 at masked positions (where anything may sit)."""
    if weights_BT is None:
        return None
    _check_shapes(valid_BT, weights_BT=weights_BT)
    return torch.where(valid_BT, weights_BT.detach().to(dtype), 1.0)


def _weighted(loss_BT: Tensor, w_BT: Tensor | None) -> Tensor:
    # x * 1.0 == x exactly in IEEE arithmetic, so all-ones weights reproduce the unweighted loss bit for bit.
    return loss_BT if w_BT is None else loss_BT * w_BT


def _seq_mean_token_mean(agg: AggArgs) -> AggArgs:
    return dataclasses.replace(agg, mode="seq-mean-token-mean")


def _masked_mean(x_BT: Tensor, valid_BT: Tensor) -> Tensor:
    valid_BT = valid_BT.to(x_BT.dtype)
    return ((x_BT * valid_BT).sum() / valid_BT.sum().clamp(min=1)).detach()


def _log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor) -> Tensor:
    return (logprobs_BT - old_logprobs_BT).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)


def _common_metrics(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, ratio_BT: Tensor, valid_BT: Tensor
) -> dict[str, Tensor]:
    return {
        "approx_kl": _masked_mean((old_logprobs_BT - logprobs_BT).detach(), valid_BT),
        "ratio_mean": _masked_mean(ratio_BT.detach(), valid_BT),
    }


def _clip_metrics(clipped_BT: Tensor, adv_BT: Tensor, valid_BT: Tensor) -> dict[str, Tensor]:
    clipped_BT = clipped_BT.detach()
    return {
        "clip_frac": _masked_mean(clipped_BT.float(), valid_BT),
        "clip_frac_upper": _masked_mean((clipped_BT & (adv_BT > 0)).float(), valid_BT),
        "clip_frac_lower": _masked_mean((clipped_BT & (adv_BT < 0)).float(), valid_BT),
    }


def _no_clip_metrics(device: torch.device) -> dict[str, Tensor]:
    zero = torch.zeros((), device=device)
    return {"clip_frac": zero, "clip_frac_upper": zero, "clip_frac_lower": zero}


def _ppo_surrogate(adv_BT: Tensor, ratio_BT: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r)) and where the clipped term won (the gradient was cut)."""
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT


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
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT).exp()
    loss_BT, clipped_BT = _ppo_surrogate(adv_BT, ratio_BT, clip_low, clip_high)
    metrics = _clip_metrics(clipped_BT, adv_BT, valid_BT)

    if clip_ratio_c is None:
        metrics["dual_clip_frac"] = torch.zeros((), device=loss_BT.device)
    else:
        cap_BT = -adv_BT * clip_ratio_c
        negative_BT = adv_BT < 0
        metrics["dual_clip_frac"] = _masked_mean((negative_BT & (loss_BT > cap_BT)).float(), valid_BT)
        loss_BT = torch.where(negative_BT, torch.minimum(loss_BT, cap_BT), loss_BT)

    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(_weighted(loss_BT, w_BT), mask_BT), metrics


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
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)
    m_BT = valid_BT.to(logprobs_BT.dtype)

    n_B = m_BT.sum(dim=-1).clamp(min=1)
    log_seq_ratio_B = ((logprobs_BT.detach() - old_logprobs_BT) * m_BT).sum(dim=-1) / n_B
    log_seq_ratio_BT = log_seq_ratio_B.unsqueeze(-1) + logprobs_BT - logprobs_BT.detach()
    log_seq_ratio_BT = log_seq_ratio_BT.clamp(max=_GSPO_LOG_RATIO_MAX)
    seq_ratio_BT = log_seq_ratio_BT.exp()
    loss_BT, clipped_BT = _ppo_surrogate(adv_BT, seq_ratio_BT, clip_low, clip_high)

    token_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT).exp()
    metrics = _clip_metrics(clipped_BT, adv_BT, valid_BT)
    metrics["seq_ratio_mean"] = _masked_mean(seq_ratio_BT.detach(), valid_BT)
    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, token_ratio_BT, valid_BT)
    return _seq_mean_token_mean(agg)(_weighted(loss_BT, w_BT), mask_BT), metrics


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
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT).exp()
    clip_weight_BT = ratio_BT.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = -clip_weight_BT * adv_BT * logprobs_BT

    truncated_BT = (ratio_BT < 1.0 - clip_low) | (ratio_BT > 1.0 + clip_high)
    metrics = _clip_metrics(truncated_BT, adv_BT, valid_BT)
    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(_weighted(loss_BT, w_BT), mask_BT), metrics


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
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT).exp()
    tau_BT = torch.where(adv_BT > 0, tau_pos, tau_neg).to(ratio_BT.dtype)
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
    loss_BT = -(gate_BT * 4.0 / tau_BT) * adv_BT

    gate_BT = gate_BT.detach()
    metrics = _no_clip_metrics(loss_BT.device)
    metrics["soft_gate_weight"] = _masked_mean(4.0 * gate_BT * (1.0 - gate_BT), valid_BT)
    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return _seq_mean_token_mean(agg)(_weighted(loss_BT, w_BT), mask_BT), metrics


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
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    loss_BT = -adv_BT * logprobs_BT
    ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT).exp()
    metrics = _no_clip_metrics(loss_BT.device)
    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(_weighted(loss_BT, w_BT), mask_BT), metrics


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
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)
    m_BT = valid_BT.to(logprobs_BT.dtype)

    n_B = m_BT.sum(dim=-1).clamp(min=1)
    seq_adv_B = (adv_BT * m_BT).sum(dim=-1) / n_B
    sign_B1 = torch.sign(seq_adv_B).unsqueeze(-1)
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT)
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
        "clip_frac": _masked_mean(cut_BT.float(), valid_BT),
        "clip_frac_upper": _masked_mean((outside_BT & (adv_BT > 0)).float(), valid_BT),
        "clip_frac_lower": _masked_mean((outside_BT & (adv_BT < 0)).float(), valid_BT),
        "seq_ratio_mean": _masked_mean(seq_ratio_B.detach().unsqueeze(-1).expand_as(m_BT), valid_BT),
    }
    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, log_ratio_BT.exp(), valid_BT)
    return _seq_mean_token_mean(agg)(loss_BT, mask_BT), metrics


def _centred_covariance(adv_BT: Tensor, logprobs_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """Per-token (A_t - mean A) (logp_t - mean logp), means over this micro-batch's valid tokens (no gradient)."""
    logprobs_BT = logprobs_BT.detach()
    return (adv_BT - _masked_mean(adv_BT, valid_BT)) * (logprobs_BT - _masked_mean(logprobs_BT, valid_BT))


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
    given (as in verl and the paper's code), so the result depends on the micro-batching (`MICRO_BATCH_LOCAL_LOSSES`).

    Returns:
        `(loss, metrics)`: metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower` (PPO's clip), `cov_clip_frac`
        (fraction of valid tokens drawn: verl's `pg_clipfrac` for this loss), `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT).exp()
    surrogate_BT, clipped_BT = _ppo_surrogate(adv_BT, ratio_BT, clip_low, clip_high)
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

    metrics = _clip_metrics(clipped_BT, adv_BT, valid_BT)
    metrics["cov_clip_frac"] = _masked_mean(drawn_BT.float(), valid_BT)
    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(_weighted(loss_BT, w_BT), mask_BT), metrics


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
    depends on the micro-batching (`MICRO_BATCH_LOCAL_LOSSES`). No clip. verl's default
    coefficient is 0.1; the paper's recipes use 1.0 with kl_cov_ratio 2e-3 (7B) or 2e-4 (32B).

    Returns:
        `(loss, metrics)`: metrics `clip_frac`, `clip_frac_upper`, `clip_frac_lower` (always 0), `kl_cov_frac`
        (fraction of valid tokens penalised), `abs_kl` (mean |logp - old|: verl's `ppo_kl` for this loss),
        `approx_kl`, `ratio_mean`.
    """
    logprobs_BT, old_logprobs_BT, adv_BT, valid_BT = _prepare(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    w_BT = _prepare_weights(weights_BT, valid_BT, logprobs_BT.dtype)

    ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT).exp()
    abs_kl_BT = (logprobs_BT - old_logprobs_BT).abs()
    cov_BT = _centred_covariance(adv_BT, logprobs_BT, valid_BT)
    valid_idx = valid_BT.flatten().nonzero().squeeze(-1)
    penalised_BT = torch.zeros_like(valid_BT)
    if valid_idx.numel() > 0:
        k = max(1, int(valid_idx.numel() * kl_cov_ratio))
        top = torch.topk(cov_BT.flatten()[valid_idx], k).indices
        penalised_BT = penalised_BT.flatten().index_fill_(0, valid_idx[top], True).view_as(valid_BT)
    loss_BT = -adv_BT * ratio_BT + torch.where(penalised_BT, kl_cov_coef * abs_kl_BT, 0.0)

    metrics = _no_clip_metrics(loss_BT.device)
    metrics["kl_cov_frac"] = _masked_mean(penalised_BT.float(), valid_BT)
    metrics["abs_kl"] = _masked_mean(abs_kl_BT.detach(), valid_BT)
    metrics |= _common_metrics(logprobs_BT, old_logprobs_BT, ratio_BT, valid_BT)
    return agg(_weighted(loss_BT, w_BT), mask_BT), metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
    "sapo": sapo,
    "gpg": gpg_loss,
    "gmpo": gmpo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
}
"""Name -> policy loss function (its options unbound; ``rlspmd.config.POLICY_LOSS_TYPES`` has the components)."""


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_range: float | None,
    agg: AggArgs,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).

    The value clipping of the PPO reference implementation (OpenAI baselines; Schulman et al. 2017, arXiv
    1707.06347): the new value may not move more than `clip_range` from the rollout's value to lower the loss.
    `clip_range=None` disables it (plain 0.5 (v - R)^2).

    Args:
        values_BT: (B, T) current critic values, carrying gradient.
        old_values_BT: (B, T) critic values at rollout time (constant).
        returns_BT: (B, T) targets, e.g. `gae(...)[1]` (constant).
        mask_BT: (B, T) response mask.
        clip_range: c above, > 0, or None.
        agg: aggregation settings.

    Returns:
        `(loss, metrics)`: metrics `vf_clip_frac` (fraction of valid tokens where the clipped term was the larger,
        i.e. the gradient was cut).
    """
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"value_loss: clip_range must be > 0 or None, got {clip_range}")
    _check_shapes(mask_BT, values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    old_values_BT, returns_BT = old_values_BT.detach(), returns_BT.detach()
    valid_BT = mask_BT > 0

    unclipped_BT = (values_BT - returns_BT).square()
    if clip_range is None:
        loss_BT = 0.5 * unclipped_BT
        clip_frac = torch.zeros((), device=values_BT.device)
    else:
        clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_range, clip_range)
        clipped_BT = (clipped_values_BT - returns_BT).square()
        loss_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT)
        clip_frac = _masked_mean((clipped_BT > unclipped_BT).float(), valid_BT)
    return agg(loss_BT, mask_BT), {"vf_clip_frac": clip_frac}


def entropy_bonus(entropy_BT: Tensor, mask_BT: Tensor, *, agg: AggArgs) -> Tensor:
    """Aggregated per-token policy entropy, to be SUBTRACTED from the loss: `loss - coef * entropy_bonus(...)`.

    Args:
        entropy_BT: (B, T) entropy of the policy's next-token distribution at each response position (carries
            gradient when the bonus is trained on).
        mask_BT: (B, T) response mask.
        agg: aggregation settings (use the policy loss's, so both are normalised alike).

    Returns:
        0-dim tensor `agg(entropy_BT, mask_BT)`.
    """
    _check_shapes(mask_BT, entropy_BT=entropy_BT)
    return agg(entropy_BT, mask_BT)
