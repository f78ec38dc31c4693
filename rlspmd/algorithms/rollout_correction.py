"""Rollout correction: importance weights pi_train / pi_rollout, truncation, rejection, and mismatch metrics.

The rollout engine samples from its own numerics (vLLM kernels, a bf16 copy of the weights, stale weights in
asynchronous RL), so the samples come from pi_rollout while the loss is written for pi_train (the trainer's
log-probs of the behaviour policy, `old_logprobs`). This module computes, from the log-probs of the SAMPLED tokens
under both, the correction a policy loss applies and the metrics that show how far apart the two are:

* ratio rho = pi_train / pi_rollout, per token, or per sequence as the GEOMETRIC MEAN of its token ratios,
  exp(mean over valid tokens of (log pi_train - log pi_rollout)) (length-normalised, as GSPO's ratio; verl's
  `rollout_is="sequence"` and TRL's sequence modes use the product instead, which for long responses drifts far
  from 1 even when every token agrees closely);
* `tis` (truncated importance sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl): weight = min(rho, tis_threshold),
  multiplied into the per-token loss (`weights_BT` of every policy loss);
* `mis` (masked importance sampling / rejection; Liu et al. 2025, "When Speed Kills Stability",
  https://richardli.xyz/rl-collapse): tokens, or whole sequences, whose rho lies outside [mis_lower, mis_upper]
  leave the loss mask (`mask_BT` of every policy loss); this is verl's `rollout_rs` with the `token_k1` /
  `seq_mean_k1` criteria, whose band "lo_hi" bounds 1/rho = pi_rollout / pi_train, so it equals ours with
  [mis_lower, mis_upper] = [1/hi, 1/lo] (the same band when it is symmetric, lo = 1/hi, as the defaults are);
* `both`: truncation and rejection; `off`: weights 1, mask unchanged.

The metrics are computed in every mode, so the mismatch is visible before the correction is switched on.
Reference: verl's `verl/trainer/ppo/rollout_corr_helper.py` (`compute_rollout_correction_and_rejection_mask`,
`compute_offpolicy_metrics`), matched in meaning; its metric set is trimmed to the ones named below.

Simplifications: the weights are never renormalised to mean 1 (verl's `rollout_is_batch_normalize`); only the
ratio criterion rejects (verl also offers k2 / k3 divergence criteria and sequence sums / maxima).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


import torch
from torch import Tensor

from rlspmd.components import Problem


@dataclass
class RolloutCorrectionConfig:
    """Correct the policy loss for the rollout engine's probabilities differing from the trainer's.

    With rho = pi_train / pi_rollout of each sampled token (``old_logprobs`` over the engine's ``rollout_logprobs``),
    or of each sequence as the geometric mean of its token ratios: ``tis`` multiplies each token's loss by
    min(rho, ``tis_threshold``) (truncated importance sampling), ``mis`` drops tokens or whole sequences whose rho
    leaves [``mis_lower``, ``mis_upper``] from the loss (masked importance sampling / rejection), ``both`` does both.
    The weights' and the mismatch's metrics (``rollout_corr/*``) are logged in every mode.
    """

    mode: Literal["auto", "off", "tis", "mis", "both"] = "auto"
    """``auto``: ``mis`` when the rollout's numerics differ from training (the vLLM engine, a rollout dtype unlike
    the actor's compute dtype), ``tis`` for asynchronous rollouts with stale weights (``trainer.max_staleness`` > 0:
    an update moves the ratio far past the rejection band), ``off`` for the native engine in the actor's compute
    dtype (it samples from the trainer's own weights and kernels). Or ``off``, ``tis``, ``mis``, ``both``
    explicitly."""
    level: Literal["token", "sequence"] = "sequence"
    """The ratio per token, or per sequence as the geometric mean of its token ratios (length-normalised; verl and
    TRL's sequence modes use the product, which drifts from 1 on long responses)."""
    tis_threshold: float = 2.0
    """Truncation cap of the importance weights (``tis``, ``both``); verl's default."""
    mis_lower: float | None = None
    """Lower end of the ratio band a token / sequence must lie in to stay (``mis``, ``both``). None: 0.999 at
    ``sequence`` level (verl's geometric rejection preset, +-0.1%), 0.5 at ``token`` level."""
    mis_upper: float | None = None
    """Upper end of the band. None: 1.001 at ``sequence`` level, 2.0 at ``token`` level."""
    metric_ratio_bound: float = 2.0
    """c of the metric ``rollout_corr/mismatch/ratio_out_of_bound_frac``: the share of tokens whose ratio leaves
    [1/c, c]."""
    bypass: bool = False
    """Use the rollout's log-probs as the old log-probs and skip the old-log-prob forward (verl's bypass mode).
    Only with one optimiser update per step (``actor.ppo_epochs=1``, ``actor.mini_batch_size`` =
    ``data.train_batch_size``) and the correction on: PPO's ratio is then pi_theta / pi_rollout, so its clip bounds
    the mismatch too, and the rejection band is applied against the current policy inside the loss. Trade-off:
    one forward fewer per step, but the clip now also spends its range on the engine mismatch."""

    def problems(self) -> list[Problem]:
        """Its own checks, collected by ``rlspmd.validate``. Every mode reads every threshold: the metrics show what
        truncation and rejection would do even where the mode applies neither, and ``auto`` may pick either."""
        out = [] if self.tis_threshold > 0 else [("tis_threshold", self.tis_threshold, "must be > 0")]
        lower, upper = self.band()
        if not 0 < lower < upper:
            out.append(
                (
                    "mis_lower",
                    self.mis_lower,
                    f"and mis_upper={self.mis_upper} must satisfy 0 < lower < upper "
                    f"(with the {self.level} level's defaults: {lower}, {upper})",
                )
            )
        if not self.metric_ratio_bound > 1:
            out.append(("metric_ratio_bound", self.metric_ratio_bound, "must be > 1"))
        return out

    def band(self) -> tuple[float, float]:
        """The rejection band [mis_lower, mis_upper] with the level's defaults filled in."""
        default_lower, default_upper = (0.999, 1.001) if self.level == "sequence" else (0.5, 2.0)
        return (
            default_lower if self.mis_lower is None else self.mis_lower,
            default_upper if self.mis_upper is None else self.mis_upper,
        )


CORRECTION_MODES = ("off", "tis", "mis", "both")
"""What the correction applies: nothing, truncated weights, rejection (masking), or both."""
CORRECTION_LEVELS = ("token", "sequence")
"""Where the ratio lives: per token, or per sequence (geometric mean of the token ratios)."""

_LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: the ratio stays finite however far apart the two log-probs are


@dataclass(frozen=True, eq=False)  # eq=False: fields are tensors
class RolloutCorrection:
    """What `rollout_correction` returns.

    Hand `weights_BT` and `mask_BT` to any policy loss (`weights_BT=`, `mask_BT`); record the metrics with
    `MetricBuffer.mean(name, *means[name])` and `.max` / `.min` for the extrema, so they reduce exactly over ranks.
    """

    weights_BT: Tensor
    """(B, T) constant per-token weight: min(rho, tis_threshold) under tis / both, 1 under mis / off; 0 wherever
    `mask_BT` is 0 (padding and rejected tokens), so multiplying it in alone also drops rejected tokens."""
    mask_BT: Tensor
    """(B, T) the input mask with the rejected tokens / sequences set to 0 (same dtype as the input mask)."""
    means: dict[str, tuple[Tensor, Tensor]]
    """Metric name -> (sum, count) on this rank; the global mean is sum / count after summing both over ranks."""
    maxima: dict[str, Tensor]
    """Metric name -> this rank's maximum (-inf when there is nothing to take it over)."""
    minima: dict[str, Tensor]
    """Metric name -> this rank's minimum (+inf when there is nothing to take it over)."""


def _check(mode: str, level: str, tis_threshold: float, mis_lower: float, mis_upper: float, ratio_bound: float) -> None:
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout correction mode {mode!r} is not one of {CORRECTION_MODES}")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"rollout correction level {level!r} is not one of {CORRECTION_LEVELS}")
    if not tis_threshold > 0:
        raise ValueError(f"rollout correction tis_threshold must be > 0, got {tis_threshold}")
    if not 0 < mis_lower < mis_upper:
        raise ValueError(f"rollout correction needs 0 < mis_lower < mis_upper, got {mis_lower}, {mis_upper}")
    if not ratio_bound > 1:
        raise ValueError(f"rollout correction ratio_bound (c of [1/c, c]) must be > 1, got {ratio_bound}")


def _sum_count(x: Tensor, where: Tensor) -> tuple[Tensor, Tensor]:
    return torch.where(where, x, 0.0).sum(), where.sum().to(x.dtype)


def _extremum(x: Tensor, where: Tensor, op: str) -> Tensor:
    fill = float("-inf") if op == "max" else float("inf")
    masked = torch.where(where, x, fill)
    return masked.amax() if op == "max" else masked.amin()


@torch.no_grad()
def rollout_correction(
    train_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    mode: str,
    level: str,
    tis_threshold: float = 2.0,
    mis_lower: float = 0.999,
    mis_upper: float = 1.001,
    ratio_bound: float = 2.0,
) -> RolloutCorrection:
    """Importance weights and rejection mask that correct a policy loss for pi_rollout != pi_train, and metrics.

    Args:
        train_logprobs_BT: (B, T) log pi_train of the sampled tokens: the trainer's old log-probs (decoupled mode),
            or the current policy's detached log-probs when the loss computes the correction itself (one update per
            step without an old-log-prob pass, or bypass mode).
        rollout_logprobs_BT: (B, T) log pi_rollout of the same tokens, as the engine sampled them.
        mask_BT: (B, T) response mask (1 valid; 0 padding and tool tokens). Nothing at a masked position is read.
        mode: `off`, `tis`, `mis` or `both` (module docstring).
        level: `token` or `sequence` (geometric mean of the token ratios).
        tis_threshold: truncation cap of the weights (verl's `rollout_is_threshold`, default 2).
        mis_lower, mis_upper: the ratio band a token (`token`) or sequence (`sequence`) must lie in to stay.
        ratio_bound: c of the mismatch metric `mismatch/ratio_out_of_bound_frac` (tokens whose ratio leaves
            [1/c, c]).

    Returns:
        `RolloutCorrection`. Metrics (a "unit" is a valid token at `token` level, a sequence with at least one
        valid token at `sequence` level; all are computed whatever `mode` is, so they show what the correction
        would do):
        * `is_ratio_mean`, `is_ratio_max`, `is_ratio_min`: rho per unit, before truncation (log clamped at +-20);
        * `is_weight_mean`: the weight applied per kept unit (after truncation; 1 under mis / off);
        * `truncated_frac`: share of units with rho > tis_threshold; `masked_frac`: share of units outside
          [mis_lower, mis_upper]; `masked_token_frac`: share of valid tokens in them;
        * `mismatch/kl_k1`: mean over valid tokens of log pi_rollout - log pi_train, the k1 (unbiased, can be < 0)
          estimate of KL(pi_rollout || pi_train) from samples of pi_rollout; `mismatch/kl_k3`: mean of
          rho - log rho - 1, the k3 estimate of the same KL (unbiased, >= 0, lower variance); both per token;
        * `mismatch/log_ppl_diff`: mean over sequences of log PPL_train - log PPL_rollout = mean_t log pi_rollout
          - mean_t log pi_train (> 0: the trainer finds the samples less likely than the engine did);
          `mismatch/log_ppl_abs_diff` its absolute value, `mismatch/log_ppl_abs_diff_max` the largest;
        * `mismatch/ratio_out_of_bound_frac`: share of valid tokens whose rho is outside [1/c, c].
    """
    _check(mode, level, tis_threshold, mis_lower, mis_upper, ratio_bound)
    if train_logprobs_BT.shape != mask_BT.shape or rollout_logprobs_BT.shape != mask_BT.shape or mask_BT.dim() != 2:
        raise ValueError(
            f"train_logprobs_BT {tuple(train_logprobs_BT.shape)}, rollout_logprobs_BT "
            f"{tuple(rollout_logprobs_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must share one "
            f"2-D shape"
        )
    dtype = torch.promote_types(torch.promote_types(train_logprobs_BT.dtype, rollout_logprobs_BT.dtype), torch.float32)
    valid_BT = mask_BT > 0
    # torch.where, not multiplication: a -inf log-prob at a padding position must not turn a sum into NaN.
    delta_BT = torch.where(valid_BT, train_logprobs_BT.detach().to(dtype) - rollout_logprobs_BT.detach().to(dtype), 0.0)
    token_log_ratio_BT = delta_BT.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    token_ratio_BT = token_log_ratio_BT.exp()
    n_B = valid_BT.sum(dim=-1)
    has_tokens_B = n_B > 0
    seq_mean_delta_B = delta_BT.sum(dim=-1) / n_B.clamp(min=1).to(dtype)

    if level == "token":
        ratio_U, unit_U = token_ratio_BT, valid_BT
        ratio_BT = token_ratio_BT
    else:
        ratio_U, unit_U = seq_mean_delta_B.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp(), has_tokens_B
        ratio_BT = ratio_U.unsqueeze(-1).expand_as(delta_BT)

    outside_U = (ratio_U < mis_lower) | (ratio_U > mis_upper)
    outside_BT = (ratio_BT < mis_lower) | (ratio_BT > mis_upper)
    keep_BT = valid_BT & ~outside_BT if mode in ("mis", "both") else valid_BT
    weight_BT = ratio_BT.clamp(max=tis_threshold) if mode in ("tis", "both") else torch.ones_like(ratio_BT)
    weights_BT = torch.where(keep_BT, weight_BT, 0.0)
    out_mask_BT = torch.where(keep_BT, mask_BT, torch.zeros_like(mask_BT))

    kept_U = unit_U & ~outside_U if mode in ("mis", "both") else unit_U
    weight_U = ratio_U.clamp(max=tis_threshold) if mode in ("tis", "both") else torch.ones_like(ratio_U)
    k3_BT = token_ratio_BT - token_log_ratio_BT - 1.0
    log_ppl_diff_B = -seq_mean_delta_B
    out_of_bound_BT = (token_ratio_BT < 1.0 / ratio_bound) | (token_ratio_BT > ratio_bound)
    means = {
        "is_ratio_mean": _sum_count(ratio_U, unit_U),
        "is_weight_mean": _sum_count(weight_U, kept_U),
        "truncated_frac": _sum_count((ratio_U > tis_threshold).to(dtype), unit_U),
        "masked_frac": _sum_count(outside_U.to(dtype), unit_U),
        "masked_token_frac": _sum_count(outside_BT.to(dtype), valid_BT),
        "mismatch/kl_k1": _sum_count(-delta_BT, valid_BT),
        "mismatch/kl_k3": _sum_count(k3_BT, valid_BT),
        "mismatch/log_ppl_diff": _sum_count(log_ppl_diff_B, has_tokens_B),
        "mismatch/log_ppl_abs_diff": _sum_count(log_ppl_diff_B.abs(), has_tokens_B),
        "mismatch/ratio_out_of_bound_frac": _sum_count(out_of_bound_BT.to(dtype), valid_BT),
    }
    maxima = {
        "is_ratio_max": _extremum(ratio_U, unit_U, "max"),
        "mismatch/log_ppl_abs_diff_max": _extremum(log_ppl_diff_B.abs(), has_tokens_B, "max"),
    }
    minima = {"is_ratio_min": _extremum(ratio_U, unit_U, "min")}
    return RolloutCorrection(weights_BT=weights_BT, mask_BT=out_mask_BT, means=means, maxima=maxima, minima=minima)
