"""From scores to advantages: per-token rewards (optionally KL-penalised), then ``algorithm.adv_estimator``.

``TokenRewards`` places each sample's score on its last response token (``token_rewards_BR``);
``KLPenalizedTokenRewards`` also subtracts ``coef * KL(pi_old || pi_ref)`` from every token (InstructGPT-style
PPO, REINFORCE++), with the coefficient of ``algorithm.kl_ctrl``'s controller, whose state is checkpointed through
``state_dict`` (the builder lists it in the checkpoint's trainer state). Its KL is global: per-sample mean KLs and the
number of samples summed over the DP ranks, so the adaptive coefficient is the same on every rank.

``AdvantageStage`` calls the estimator that ``algorithm.adv_estimator`` builds (``rlspmd.algorithms.estimators``),
handing it the DP mesh's sum for what must be global. Numbers follow verl's (``verl/trainer/ppo/core_algos.py``).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.algorithms import apply_kl_in_reward, sample_mean_kl, token_level_scores
from rlspmd.algorithms.estimators import AdvantageEstimator
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
        """``cfg.kl_penalty`` and ``cfg.kl_ctrl`` were checked by ``rlspmd.validate``."""
        self.kind, self.mesh = cfg.kl_penalty, mesh
        self.controller = cfg.kl_ctrl.build()

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        mask = batch["loss_mask_BR"].float()
        coef = self.controller.value
        rewards, kl = apply_kl_in_reward(
            token_level_scores(batch["scores_B"], mask),
            batch["old_logprobs_BR"],
            batch["ref_logprobs_BR"],
            mask,
            coef=coef,
            kind=self.kind,
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

    def __init__(self, estimator: AdvantageEstimator, *, mesh: DeviceMesh | None):
        """``estimator`` (``algorithm.adv_estimator``) was checked by ``rlspmd.validate``."""
        self.estimate = estimator.build(all_reduce=partial(all_reduce_sum, mesh=mesh))

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        adv, ret = self.estimate(batch)
        return batch.set(advantages_BR=adv, returns_BR=ret)
