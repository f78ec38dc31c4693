"""The advantage estimators as the advantage stage applies them to a batch.

Each function reads its inputs from the batch (``token_rewards_BR``, ``loss_mask_BR``, ``uid_B`` and what the
estimator needs besides: ``values_BR``, ``baseline_scores_B``, ``reward_components_BK``), calls the pure function of
``advantages.py`` and returns ``(advantages_BR, returns_BR)``; its options are bound by its config component
(``rlspmd.config``: ``GAE``, ``GRPO``, ...). All of a prompt's samples live on one DP rank, so group statistics are
local and exact; what must be global is made global through ``all_reduce``, a sum over the DP ranks that the stage
hands in (no process group here), so the result does not depend on the number of ranks: whitening (GAE, the
REINFORCE++ variants and GDPO: ``masked_moments`` summed over ranks) and GPG's alpha (the counts of rows and of
non-zero scores). Outcome estimators read the sequence score ``token_rewards_BR.sum(-1)`` (the score itself without
a KL penalty); ReMax reads the per-token rewards (its reward-to-go); GDPO reads ``reward_components_BK``, one column
per reward component.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rlspmd.algorithms.advantages import (
    gae,
    gdpo_combine,
    gpg,
    gpg_alpha,
    grpo_outcome,
    grpo_passk,
    masked_moments,
    masked_whiten,
    opo,
    reinforce_pp,
    remax,
    rloo,
)
from rlspmd.protocol import Batch

AllReduce = Callable[[Tensor], Tensor]
"""A sum over the DP ranks (a new tensor); on one rank, a copy."""


def whiten(x_BR: Tensor, mask_BR: Tensor, *, all_reduce: AllReduce) -> Tensor:
    """Whiten over the valid tokens of the global batch: local moments, one all-reduce."""
    return masked_whiten(x_BR, mask_BR, moments=all_reduce(masked_moments(x_BR, mask_BR)))


def _inputs(batch: Batch) -> tuple[Tensor, Tensor]:
    return batch["token_rewards_BR"], batch["loss_mask_BR"].float()


def gae_estimate(batch: Batch, *, gamma: float, lam: float, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    adv, ret = gae(rewards, batch["values_BR"], mask, gamma=gamma, lam=lam)
    return whiten(adv, mask, all_reduce=all_reduce), ret


def grpo_estimate(batch: Batch, *, norm_adv_by_std: bool, eps: float) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return grpo_outcome(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=norm_adv_by_std, eps=eps)


def grpo_passk_estimate(batch: Batch, *, norm_adv_by_std: bool, eps: float) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return grpo_passk(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=norm_adv_by_std, eps=eps)


def rloo_estimate(batch: Batch) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return rloo(rewards.sum(-1), mask, batch["uid_B"])


def opo_estimate(batch: Batch) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return opo(rewards.sum(-1), mask, batch["uid_B"])


def reinforce_pp_estimate(batch: Batch, *, gamma: float, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    _, returns = reinforce_pp(rewards, mask, gamma=gamma)  # its own whitening is local; redo it globally
    return whiten(returns, mask, all_reduce=all_reduce), returns


def reinforce_pp_baseline_estimate(batch: Batch, *, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    centred, _ = grpo_outcome(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=False)
    adv = whiten(centred, mask, all_reduce=all_reduce)
    return adv, adv


def remax_estimate(batch: Batch) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return remax(rewards, batch["baseline_scores_B"], mask)  # reward-to-go of the (KL-penalised) token rewards


def gpg_estimate(batch: Batch, *, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    scores = rewards.sum(-1)
    rows = torch.tensor(float(len(batch)), dtype=torch.float64, device=scores.device)
    counts = all_reduce(torch.stack([rows, torch.count_nonzero(scores).double()]))
    alpha = gpg_alpha(num_rows=float(counts[0]), num_nonzero_scores=float(counts[1]))
    return gpg(scores, mask, batch["uid_B"], norm_by_std=False, alpha=alpha)  # F_norm = 1, the paper's best setting


def gdpo_estimate(
    batch: Batch, *, reward_weights: list[float] | None, norm_adv_by_std: bool, eps: float, all_reduce: AllReduce
) -> tuple[Tensor, Tensor]:
    """``reward_weights`` has one entry per column of ``reward_components_BK`` (``rlspmd.validate`` checked it
    against the reward components the run configures)."""
    _, mask = _inputs(batch)
    components = batch["reward_components_BK"]
    assert reward_weights is None or len(reward_weights) == components.shape[1], (reward_weights, components.shape)
    combined = gdpo_combine(
        components, mask, batch["uid_B"], weights_K=reward_weights, norm_by_std=norm_adv_by_std, eps=eps
    )
    adv = whiten(combined, mask, all_reduce=all_reduce)
    return adv, adv
