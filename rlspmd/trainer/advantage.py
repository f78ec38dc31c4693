"""From scores to advantages: per-token rewards (optionally KL-penalised), then ``algorithm.adv_estimator``.

``TokenRewards`` places each sample's score on its last response token (``token_rewards_BR``);
``KLPenalizedTokenRewards`` also subtracts ``coef * KL(pi_old || pi_ref)`` from every token (InstructGPT-style
PPO, REINFORCE++), with a fixed or adaptive coefficient whose state is checkpointed through ``state_dict`` (the
builder lists it in the checkpoint's trainer state).

``AdvantageStage`` maps the estimator name to the pure function in ``rlspmd.algorithms``. Outcome estimators read
the sequence score ``token_rewards_BR.sum(-1)`` (the score itself without a KL penalty) and group samples by
``uid_B``; ReMax reads the per-token rewards (its reward-to-go); GDPO reads ``reward_components_BK``, one column per
reward component. All of a prompt's samples live on one DP rank, so group statistics are local and exact. What must
be global is made global with one all-reduce on the DP mesh, so the result does not depend on the number of ranks:
whitening (GAE, the REINFORCE++ variants and GDPO: ``masked_moments`` summed over ranks), GPG's alpha (counts of
rows and of non-zero scores summed over ranks) and the adaptive KL controller's current KL (per-sample mean KLs and
the number of samples summed over ranks). Numbers follow verl's (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
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
    sample_mean_kl,
    token_level_scores,
)
from rlspmd.config import AlgorithmConfig
from rlspmd.distributed.dispatch import all_reduce_sum
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch

class TokenRewards:
    """``token_rewards_BR``: the score on the last valid response token, 0 elsewhere. Stateless."""

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        token_scores = token_level_scores(batch["scores_B"], batch["loss_mask_BR"].float())
        return batch.set(token_rewards_BR=token_scores)


class KLPenalizedTokenRewards:
    """``token_rewards_BR = token_level_scores - coef * KL_t`` with KL from the behaviour policy's log-probs.

    The controller sees the step's KL as verl's ``apply_kl_penalty`` computes it, the mean over samples of each
    sample's mean KL over its valid tokens, over the GLOBAL batch (one all-reduce of the per-sample sum and the
    number of samples), and the global number of samples, so its coefficient is identical on every rank. That KL is
    also the logged ``kl_in_reward/kl``.
    """

    def __init__(self, cfg: AlgorithmConfig, *, mesh: DeviceMesh | None):
        """``cfg.kl_penalty`` was checked by ``rlspmd.validate``."""
        c = cfg.kl_ctrl
        self.kind, self.mesh = cfg.kl_penalty, mesh
        if c.type == "fixed":
            self.controller = FixedKLController(c.kl_coef)
        elif c.type == "adaptive":
            try:
                self.controller = AdaptiveKLController(c.kl_coef, c.target_kl, c.horizon)
            except ValueError as e:
                raise ValueError(f"algorithm.kl_ctrl: {e}") from None
        else:
            raise ValueError(f"algorithm.kl_ctrl.type={c.type!r} must be 'fixed' or 'adaptive'")

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        mask = batch["loss_mask_BR"].float()
        coef = self.controller.value
        rewards, kl = apply_kl_in_reward(
            token_level_scores(batch["scores_B"], mask), batch["old_logprobs_BR"], batch["ref_logprobs_BR"], mask,
            coef=coef, kind=self.kind,
        )
        rows = torch.tensor(float(len(batch)), dtype=torch.float64, device=mask.device)
        totals = all_reduce_sum(torch.stack([sample_mean_kl(kl, mask).sum().double(), rows]), mesh=self.mesh)
        mean_kl = float(totals[0] / totals[1].clamp(min=1))
        self.controller.update(mean_kl, n_steps=int(totals[1]))
        metrics.max("kl_in_reward/kl", mean_kl)
        metrics.max("kl_in_reward/coef", coef)
        return batch.set(token_rewards_BR=rewards)

    def state_dict(self) -> dict:
        return {"kl_ctrl": self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["kl_ctrl"])


def build_token_rewards(cfg: AlgorithmConfig, *, mesh: DeviceMesh | None):
    return KLPenalizedTokenRewards(cfg, mesh=mesh) if cfg.use_kl_in_reward else TokenRewards()


class AdvantageStage:
    """Adds ``advantages_BR`` and ``returns_BR`` (the critic's targets for GAE) from ``token_rewards_BR``."""

    def __init__(self, cfg: AlgorithmConfig, *, mesh: DeviceMesh | None):
        """``cfg`` was checked by ``rlspmd.validate`` (a known estimator, grpo_eps >= 0)."""
        self.cfg, self.mesh = cfg, mesh
        self.estimate = self.estimators()[cfg.adv_estimator]

    def estimators(self) -> dict:
        """Each ``algorithm.adv_estimator`` name and the method that applies it (the names of
        ``rlspmd.algorithms.ADVANTAGE_ESTIMATORS``; tests/test_algorithms_stages.py holds the two to each other)."""
        return {"gae": self._gae, "grpo": self._grpo, "grpo_passk": self._grpo_passk, "rloo": self._rloo, "opo": self._opo,
                "reinforce_pp": self._reinforce_pp, "reinforce_pp_baseline": self._reinforce_pp_baseline,
                "remax": self._remax, "gpg": self._gpg, "gdpo": self._gdpo}

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        mask = batch["loss_mask_BR"].float()
        adv, ret = self.estimate(batch, batch["token_rewards_BR"], mask)
        return batch.set(advantages_BR=adv, returns_BR=ret)

    def whiten(self, x_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
        """Whiten over the valid tokens of the global batch: local moments, one all-reduce."""
        moments = all_reduce_sum(masked_moments(x_BR, mask_BR), mesh=self.mesh)
        return masked_whiten(x_BR, mask_BR, moments=moments)

    def _gae(self, batch, rewards, mask):
        adv, ret = gae(rewards, batch["values_BR"], mask, gamma=self.cfg.gamma, lam=self.cfg.lam)
        return self.whiten(adv, mask), ret

    def _grpo(self, batch, rewards, mask):
        return grpo_outcome(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=self.cfg.norm_adv_by_std,
                            eps=self.cfg.grpo_eps)

    def _grpo_passk(self, batch, rewards, mask):
        return grpo_passk(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=self.cfg.norm_adv_by_std,
                          eps=self.cfg.grpo_eps)

    def _rloo(self, batch, rewards, mask):
        return rloo(rewards.sum(-1), mask, batch["uid_B"])

    def _opo(self, batch, rewards, mask):
        return opo(rewards.sum(-1), mask, batch["uid_B"])

    def _reinforce_pp(self, batch, rewards, mask):
        _, returns = reinforce_pp(rewards, mask, gamma=self.cfg.gamma)  # its own whitening is local; redo it globally
        return self.whiten(returns, mask), returns

    def _reinforce_pp_baseline(self, batch, rewards, mask):
        centred, _ = grpo_outcome(rewards.sum(-1), mask, batch["uid_B"], norm_by_std=False)
        adv = self.whiten(centred, mask)
        return adv, adv

    def _remax(self, batch, rewards, mask):
        return remax(rewards, batch["baseline_scores_B"], mask)  # reward-to-go of the (KL-penalised) token rewards

    def _gpg(self, batch, rewards, mask):
        scores = rewards.sum(-1)
        rows = torch.tensor(float(len(batch)), dtype=torch.float64, device=scores.device)
        counts = all_reduce_sum(torch.stack([rows, torch.count_nonzero(scores).double()]), mesh=self.mesh)
        alpha = gpg_alpha(num_rows=float(counts[0]), num_nonzero_scores=float(counts[1]))
        return gpg(scores, mask, batch["uid_B"], norm_by_std=False, alpha=alpha)  # F_norm = 1, the paper's best setting

    def _gdpo(self, batch, rewards, mask):
        if "reward_components_BK" not in batch:
            raise ValueError("algorithm.adv_estimator='gdpo' needs the batch field reward_components_BK (B, K): one "
                             "column per reward component, from the reward manager")
        components = batch["reward_components_BK"]
        weights = self.cfg.gdpo_reward_weights
        if weights is not None and len(weights) != components.shape[1]:
            raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} entries but the reward manager "
                             f"produced {components.shape[1]} reward components (reward_components_BK)")
        combined = gdpo_combine(components, mask, batch["uid_B"], weights_K=weights,
                                norm_by_std=self.cfg.norm_adv_by_std, eps=self.cfg.grpo_eps)
        adv = self.whiten(combined, mask)
        return adv, adv
