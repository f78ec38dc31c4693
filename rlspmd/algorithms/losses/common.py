"""Policy and value losses: pure functions from log-probabilities and advantages to a scalar loss and metrics.

Every policy loss has the same tensor arguments and its own keyword options:

    fn(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, weights_BT=None, <its options>) -> (loss, metrics)

Each function sits beside its config component (``PPOClip``, ``GSPO``, ...: a ``PolicyLoss``), whose fields are
the options, whose ``problems()`` checks them (called by ``rlspmd.validate`` before anything loads) and whose
``build()`` binds them to the function for the trainer; the functions assume valid options. Defining a
``PolicyLoss`` subclass registers it in ``POLICY_LOSSES`` (``rlspmd/components.py``): a loss added to rlspmd is a
module here plus its import in this package's ``__init__``; a user's loss is a subclass in their own file.

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
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from rlspmd.algorithms.aggregation import AggArgs
from rlspmd.components import Component, Problem, Registry

_LOG_RATIO_LIMIT = 20.0

LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""``fn(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, *, agg, weights_BT=None) -> (loss, metrics)``: a policy
loss with its options bound."""

POLICY_LOSSES = Registry("policy loss")
"""Every policy loss by its name (the command line's subcommand, ``actor.policy-loss:NAME``)."""


class PolicyLoss(Component):
    """``actor.policy_loss``: a policy loss with its options (the dataclass fields of a subclass).

    Traits the trainer reads: ``per_sequence``, the loss aggregates ``seq-mean-token-mean`` whatever
    ``actor.loss_agg_mode`` says (verl's GSPO, SAPO, GMPO); ``micro_batch_local``, its token selection uses statistics
    of the micro-batch it is given, so its gradient depends on how a mini-batch is split over ranks and micro-batches
    (every other loss gives the same gradient for any split)."""

    registry = POLICY_LOSSES
    per_sequence: ClassVar[bool] = False
    micro_batch_local: ClassVar[bool] = False

    def build(self, *, generator: torch.Generator | None = None) -> LossFn:
        """The loss with its options bound. ``generator``: the seeded draws of a loss that draws tokens (per rank)."""
        raise NotImplementedError


def clip_problems(low: float, high: float) -> list[Problem]:
    return [(name, v, "must be >= 0") for name, v in (("clip_ratio_low", low), ("clip_ratio_high", high)) if v < 0]


def fraction_problems(name: str, value: float) -> list[Problem]:
    return [] if 0 < value <= 1 else [(name, value, "must be in (0, 1] (a fraction of a micro-batch's valid tokens)")]


def check_shapes(mask_BT: Tensor, **tensors_BT: Tensor) -> None:
    shape = tuple(mask_BT.shape)
    for name, x in tensors_BT.items():
        if tuple(x.shape) != shape or len(shape) != 2:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected the 2-D shape of mask_BT {shape}")


def prepare(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Check shapes, make old log-probs and advantages constants, and zero all three at masked positions.

    Zeroing with `torch.where` (whose backward gives the unselected branch exactly 0) keeps a non-finite value at
    a padding position, e.g. a -inf log-prob, from reaching the loss or the gradient as NaN.
    """
    check_shapes(mask_BT, logprobs_BT=logprobs_BT, old_logprobs_BT=old_logprobs_BT, advantages_BT=advantages_BT)
    valid_BT = mask_BT > 0
    logprobs_BT = torch.where(valid_BT, logprobs_BT, 0.0)
    old_logprobs_BT = torch.where(valid_BT, old_logprobs_BT.detach(), 0.0)
    advantages_BT = torch.where(valid_BT, advantages_BT.detach(), 0.0)
    return logprobs_BT, old_logprobs_BT, advantages_BT, valid_BT


def prepare_weights(weights_BT: Tensor | None, valid_BT: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The per-token weights as a constant of the loss's dtype, 1 at masked positions (where anything may sit)."""
    if weights_BT is None:
        return None
    check_shapes(valid_BT, weights_BT=weights_BT)
    return torch.where(valid_BT, weights_BT.detach().to(dtype), 1.0)


def weighted(loss_BT: Tensor, w_BT: Tensor | None) -> Tensor:
    # x * 1.0 == x exactly in IEEE arithmetic, so all-ones weights reproduce the unweighted loss bit for bit.
    return loss_BT if w_BT is None else loss_BT * w_BT


def seq_mean_token_mean(agg: AggArgs) -> AggArgs:
    return dataclasses.replace(agg, mode="seq-mean-token-mean")


def masked_mean(x_BT: Tensor, valid_BT: Tensor) -> Tensor:
    valid_BT = valid_BT.to(x_BT.dtype)
    return ((x_BT * valid_BT).sum() / valid_BT.sum().clamp(min=1)).detach()


def log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor) -> Tensor:
    return (logprobs_BT - old_logprobs_BT).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)


def common_metrics(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, ratio_BT: Tensor, valid_BT: Tensor
) -> dict[str, Tensor]:
    return {
        "approx_kl": masked_mean((old_logprobs_BT - logprobs_BT).detach(), valid_BT),
        "ratio_mean": masked_mean(ratio_BT.detach(), valid_BT),
    }


def clip_metrics(clipped_BT: Tensor, adv_BT: Tensor, valid_BT: Tensor) -> dict[str, Tensor]:
    clipped_BT = clipped_BT.detach()
    return {
        "clip_frac": masked_mean(clipped_BT.float(), valid_BT),
        "clip_frac_upper": masked_mean((clipped_BT & (adv_BT > 0)).float(), valid_BT),
        "clip_frac_lower": masked_mean((clipped_BT & (adv_BT < 0)).float(), valid_BT),
    }


def no_clip_metrics(device: torch.device) -> dict[str, Tensor]:
    zero = torch.zeros((), device=device)
    return {"clip_frac": zero, "clip_frac_upper": zero, "clip_frac_lower": zero}


def ppo_surrogate(adv_BT: Tensor, ratio_BT: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """max(-A r, -A clip(r)) and where the clipped term won (the gradient was cut)."""
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT
