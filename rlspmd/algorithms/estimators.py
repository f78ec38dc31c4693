"""The advantage estimators as the advantage stage applies them to a batch, each beside its config component.

Each function reads its inputs from the batch (``token_rewards_BR``, ``loss_mask_BR``, ``uid_B`` and what the
estimator needs besides: ``values_BR``, ``baseline_scores_B``, ``reward_components_BK``), calls the pure function of
``advantages.py`` and returns ``(advantages_BR, returns_BR)``; its options are bound by its config component
(an ``AdvantageEstimator``: ``GAE``, ``GRPO``, ...; ``algorithm.adv_estimator`` holds one, picked on the command line
like the policy loss: ``algorithm.adv-estimator:gae --algorithm.adv-estimator.lam 0.95``). All of a prompt's
samples live on one DP rank, so group statistics are local and exact; what must be global is made global through
``all_reduce``, a sum over the DP ranks that the stage hands in (no process group here), so the result does not
depend on the number of ranks: whitening (GAE, the
REINFORCE++ variants and GDPO: ``masked_moments`` summed over ranks) and GPG's alpha (the counts of rows and of
non-zero scores). Outcome estimators read the sequence score ``token_rewards_BR.sum(-1)`` (the score itself without
a KL penalty); ReMax reads the per-token rewards (its reward-to-go); GDPO reads ``reward_components_BK``, one column
per reward component.

A component's class variables say what the rest of the run must provide: a critic (``uses_critic``), one greedy
response per prompt, scored (``uses_greedy_baseline``), the reward components instead of the token rewards
(``uses_reward_components``), the old log-probs before the update (``uses_old_logprobs``: their own forward), the sum
of the squared probabilities over the vocabulary at each sampled token (``uses_sum_pi_squared``: OTB; the same forward
computes it), or no reward at all (``uses_reward = False``: pure distillation, the teacher's signal is the advantage).
Defining an ``AdvantageEstimator`` subclass registers it in ``ADVANTAGE_ESTIMATORS``: a user's estimator is a subclass
in their own file (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
import tyro
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
from rlspmd.algorithms.otb import optimal_token_baseline
from rlspmd.components import Component, Problem, Registry
from rlspmd.protocol import Batch

AllReduce = Callable[[Tensor], Tensor]
"""A sum over the DP ranks (a new tensor); on one rank, a copy."""

Estimate = Callable[[Batch], tuple[Tensor, Tensor]]
"""``estimate(batch) -> (advantages_BR, returns_BR)``: an estimator with its options bound."""

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
"""Every advantage estimator by its name (``algorithm.adv-estimator:NAME``, with ``-`` for ``_``)."""

NoFlag = tyro.conf.FlagConversionOff
"""A bool option of an estimator is written ``--algorithm.adv-estimator.norm-adv-by-std False``: tyro (1.0.17) accepts
a ``--no-...`` flag of a component only after its subcommand, a value also for the component a config file chose."""


class AdvantageEstimator(Component):
    """``algorithm.adv_estimator``: an estimator with its options (the dataclass fields of a subclass)."""

    registry = ADVANTAGE_ESTIMATORS
    uses_critic: ClassVar[bool] = False
    uses_greedy_baseline: ClassVar[bool] = False
    uses_reward_components: ClassVar[bool] = False
    uses_old_logprobs: ClassVar[bool] = False
    uses_sum_pi_squared: ClassVar[bool] = False
    uses_reward: ClassVar[bool] = True

    def build(self, *, all_reduce: AllReduce) -> Estimate:
        """The estimator with its options bound; ``all_reduce`` is the advantage stage's sum over the DP ranks."""
        raise NotImplementedError


def unit_interval_problems(**values: float) -> list[Problem]:
    return [(name, v, "must be in [0, 1]") for name, v in values.items() if not 0 <= v <= 1]


def eps_problems(eps: float) -> list[Problem]:
    return [] if eps >= 0 else [("eps", eps, "must be >= 0")]


def whiten(x_BR: Tensor, mask_BR: Tensor, *, all_reduce: AllReduce) -> Tensor:
    """Whiten over the valid tokens of the global batch: local moments, one all-reduce."""
    return masked_whiten(x_BR, mask_BR, moments=all_reduce(masked_moments(x_BR, mask_BR)))


def _inputs(batch: Batch) -> tuple[Tensor, Tensor]:
    return batch["token_rewards_BR"], batch["loss_mask_BR"].float()


def gae_estimate(batch: Batch, *, gamma: float, lam: float, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    adv, ret = gae(rewards, batch["values_BR"], mask, gamma=gamma, lam=lam)
    return whiten(adv, mask, all_reduce=all_reduce), ret


@dataclass
class GAE(AdvantageEstimator):
    """PPO's generalised advantage estimation over the critic's values (builds the critic: ``critic.*``), whitened
    over the global batch."""

    name: ClassVar[str] = "gae"
    uses_critic: ClassVar[bool] = True
    gamma: float = 1.0
    """Discount factor, in [0, 1]."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]."""

    def problems(self) -> list[Problem]:
        return unit_interval_problems(gamma=self.gamma, lam=self.lam)

    def build(self, *, all_reduce):
        return partial(gae_estimate, gamma=self.gamma, lam=self.lam, all_reduce=all_reduce)


def grpo_estimate(batch: Batch, *, norm_adv_by_std: bool, eps: float) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return grpo_outcome(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=norm_adv_by_std, eps=eps)


@dataclass
class GRPO(AdvantageEstimator):
    """GRPO: each sample's score relative to its group's (the samples of one prompt) mean, divided by the group std.
    ``norm_adv_by_std=False`` is Dr.GRPO."""

    name: ClassVar[str] = "grpo"
    norm_adv_by_std: NoFlag[bool] = True
    """Divide by the group std (``--algorithm.adv-estimator.norm-adv-by-std False``: Dr.GRPO, centring only)."""
    eps: float = 1e-6
    """Added to the group std (verl's ``epsilon``, >= 0); a group of one sample keeps score / (1 + eps)."""

    def problems(self) -> list[Problem]:
        return eps_problems(self.eps)

    def build(self, *, all_reduce):
        return partial(grpo_estimate, norm_adv_by_std=self.norm_adv_by_std, eps=self.eps)


def grpo_passk_estimate(batch: Batch, *, norm_adv_by_std: bool, eps: float) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return grpo_passk(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=norm_adv_by_std, eps=eps)


@dataclass
class GRPOPassK(AdvantageEstimator):
    """pass@k GRPO: only the best sample of a group gets an advantage, its margin over the second best."""

    name: ClassVar[str] = "grpo_passk"
    norm_adv_by_std: NoFlag[bool] = True
    """Divide by the group std."""
    eps: float = 1e-6
    """Added to the group std (>= 0)."""

    def problems(self) -> list[Problem]:
        return eps_problems(self.eps)

    def build(self, *, all_reduce):
        return partial(grpo_passk_estimate, norm_adv_by_std=self.norm_adv_by_std, eps=self.eps)


def rloo_estimate(batch: Batch) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return rloo(rewards.sum(-1), mask, batch["uid_B"])


@dataclass
class RLOO(AdvantageEstimator):
    """RLOO: each sample's score minus the mean of the other samples of its group (no options)."""

    name: ClassVar[str] = "rloo"

    def build(self, *, all_reduce):
        return rloo_estimate


def opo_estimate(batch: Batch) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return opo(rewards.sum(-1), mask, batch["uid_B"])


@dataclass
class OPO(AdvantageEstimator):
    """OPO: the score minus its group's length-weighted mean score (no options)."""

    name: ClassVar[str] = "opo"

    def build(self, *, all_reduce):
        return opo_estimate


def reinforce_pp_estimate(batch: Batch, *, gamma: float, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    _, returns = reinforce_pp(rewards, mask, gamma=gamma)  # its own whitening is local; redo it globally
    return whiten(returns, mask, all_reduce=all_reduce), returns


@dataclass
class ReinforcePP(AdvantageEstimator):
    """REINFORCE++: the discounted return-to-go of the (KL-penalised) token rewards, whitened over the global batch;
    no critic, no group baseline."""

    name: ClassVar[str] = "reinforce_pp"
    gamma: float = 1.0
    """Discount factor, in [0, 1]."""

    def problems(self) -> list[Problem]:
        return unit_interval_problems(gamma=self.gamma)

    def build(self, *, all_reduce):
        return partial(reinforce_pp_estimate, gamma=self.gamma, all_reduce=all_reduce)


def reinforce_pp_baseline_estimate(batch: Batch, *, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    centred, _ = grpo_outcome(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=False)
    adv = whiten(centred, mask, all_reduce=all_reduce)
    return adv, adv


@dataclass
class ReinforcePPBaseline(AdvantageEstimator):
    """REINFORCE++-baseline: the score minus its group's mean, whitened over the global batch (no options)."""

    name: ClassVar[str] = "reinforce_pp_baseline"

    def build(self, *, all_reduce):
        return partial(reinforce_pp_baseline_estimate, all_reduce=all_reduce)


def remax_estimate(batch: Batch) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return remax(rewards, batch["baseline_scores_B"], mask)  # reward-to-go of the (KL-penalised) token rewards


@dataclass
class ReMax(AdvantageEstimator):
    """ReMax: the reward-to-go minus the score of one greedy response per prompt, generated and scored in the rollout
    stage (no options)."""

    name: ClassVar[str] = "remax"
    uses_greedy_baseline: ClassVar[bool] = True

    def build(self, *, all_reduce):
        return remax_estimate


def gpg_estimate(batch: Batch, *, all_reduce: AllReduce) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    scores = rewards.sum(-1)
    rows = torch.tensor(float(len(batch)), dtype=torch.float64, device=scores.device)
    counts = all_reduce(torch.stack([rows, torch.count_nonzero(scores).double()]))
    alpha = gpg_alpha(num_rows=float(counts[0]), num_nonzero_scores=float(counts[1]))
    return gpg(scores, mask, batch["uid_B"], norm_by_std=False, alpha=alpha)  # F_norm = 1, the paper's best setting


@dataclass
class GPGAdvantage(AdvantageEstimator):
    """GPG's advantage: the group-centred score scaled by alpha (rows over rows with a non-zero score, over the global
    batch); F_norm = 1, its paper's best setting (no options). Pair with ``actor.policy_loss=GPG()``."""

    name: ClassVar[str] = "gpg"

    def build(self, *, all_reduce):
        return partial(gpg_estimate, all_reduce=all_reduce)


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


@dataclass
class GDPO(AdvantageEstimator):
    """GDPO: several rewards (``reward_components_BK``: the rule score, the reward model's, then each of
    ``reward.components``), each normalised within its group, weighted, summed and whitened over the global batch.
    KL in the reward and overlong shaping do not reach it (they shape the token rewards it does not read)."""

    name: ClassVar[str] = "gdpo"
    uses_reward_components: ClassVar[bool] = True
    reward_weights: list[float] | None = None
    """Weight of each reward component, one per column of ``reward_components_BK`` in its order: the rule / function
    score, the reward model's score (with ``reward.model.path``), the agent's (with ``rollout.agent``), then each of
    ``reward.components``. None: all 1."""
    norm_adv_by_std: NoFlag[bool] = True
    """Divide each component by its group std."""
    eps: float = 1e-6
    """Added to each group std (>= 0)."""

    def problems(self) -> list[Problem]:
        return eps_problems(self.eps)

    def build(self, *, all_reduce):
        return partial(
            gdpo_estimate,
            reward_weights=self.reward_weights,
            norm_adv_by_std=self.norm_adv_by_std,
            eps=self.eps,
            all_reduce=all_reduce,
        )


def otb_estimate(batch: Batch, *, multi_turn: bool, handle_zero_tail: bool, eps: float) -> tuple[Tensor, Tensor]:
    rewards, mask = _inputs(batch)
    return optimal_token_baseline(
        rewards,
        mask,
        batch["uid_B"],
        batch["old_logprobs_BR"],
        batch["sum_pi_squared_BR"],
        multi_turn=multi_turn,
        handle_zero_tail=handle_zero_tail,
        eps=eps,
    )


@dataclass
class OptimalTokenBaseline(AdvantageEstimator):
    """OTB: the reward-to-go minus a per-token baseline of its group, each sample weighted by its path variance so far
    (``rlspmd/algorithms/otb.py``; verl's ``optimal_token_baseline``). Its inputs come from the old-log-prob forward:
    the old log-probs and the sum of the squared probabilities over the vocabulary (FSDP engine). Rollout correction
    applies after the advantages here, so its importance weights do not enter W."""

    name: ClassVar[str] = "optimal_token_baseline"
    uses_old_logprobs: ClassVar[bool] = True
    uses_sum_pi_squared: ClassVar[bool] = True
    multi_turn: ClassVar[bool] = False
    handle_zero_tail: NoFlag[bool] = False
    """In a group whose longest response is the only one of its length, zero its baseline past the second longest's
    length."""
    eps: float = 1e-8
    """Added to the baseline's denominator (> 0)."""

    def problems(self) -> list[Problem]:
        return [] if self.eps > 0 else [("eps", self.eps, "must be > 0")]

    def build(self, *, all_reduce):
        return partial(otb_estimate, multi_turn=self.multi_turn, handle_zero_tail=self.handle_zero_tail, eps=self.eps)


@dataclass
class MultiTurnOptimalTokenBaseline(OptimalTokenBaseline):
    """OTB for multi-turn responses: a group's samples share a baseline at their k-th model token (tool results inside a
    response are skipped) instead of at a position (verl's ``tir_optimal_token_baseline``; zero tails on by default)."""

    name: ClassVar[str] = "tir_optimal_token_baseline"
    multi_turn: ClassVar[bool] = True
    handle_zero_tail: NoFlag[bool] = True
    """In a group whose longest response is the only one of its length, zero its baseline past the second longest's
    length (counted in model tokens)."""


def no_advantage(batch: Batch) -> tuple[Tensor, Tensor]:
    zeros = torch.zeros_like(batch["loss_mask_BR"], dtype=torch.float32)
    return zeros, zeros


@dataclass
class NoAdvantage(AdvantageEstimator):
    """No reward signal: zero advantages, and the run needs no reward (``reward.rule_weight`` 0 and no reward model is
    allowed). Pure on-policy distillation: with a teacher (``teacher.model_path``) its signal is the whole advantage
    (``teacher.signal:reverse_kl``) or the whole loss (``teacher.signal:gkd``)."""

    name: ClassVar[str] = "none"
    uses_reward: ClassVar[bool] = False

    def build(self, *, all_reduce):
        return no_advantage
