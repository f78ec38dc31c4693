"""The advantage stage: maps ``algorithm.adv_estimator`` to a pure estimator from ``rlspmd.algorithms``.

Outcome estimators (GRPO family, RLOO, ...) group samples by ``uid_B``. All of a prompt's samples live on
one DP rank (they were generated there), so group statistics are local and exact.
"""

from __future__ import annotations

from rlspmd.algorithms import ADVANTAGE_ESTIMATORS, grpo_outcome, rloo
from rlspmd.config import AlgorithmConfig
from rlspmd.protocol import Batch

SUPPORTED = ("grpo", "rloo")


class AdvantageStage:
    def __init__(self, cfg: AlgorithmConfig):
        if cfg.adv_estimator not in SUPPORTED:
            known = sorted(ADVANTAGE_ESTIMATORS)
            raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator!r} is not supported by the trainer yet (library has {known})")
        self.cfg = cfg

    def __call__(self, batch: Batch) -> Batch:
        scores, mask, uid = batch["scores_B"], batch["response_mask_BR"].float(), batch["uid_B"]
        if self.cfg.adv_estimator == "grpo":
            adv, ret = grpo_outcome(scores, mask, uid, norm_by_std=self.cfg.norm_adv_by_std)
        else:
            adv, ret = rloo(scores, mask, uid)
        return batch.set(advantages_BR=adv, returns_BR=ret)
