"""The reward role: rule / function scores (``rewards/manager.py``) and, when configured, a reward model
(``roles/reward_model.py``), combined as ``scores_B = reward.rule_weight * task_scores_B + reward.model.weight *
rm_scores_B``; with multi-turn rollouts (``rollout.agent``) also ``+ reward.agent_weight * agent_rewards_B`` (the
rollout's tool reward deltas, the tools' scores of their final states, e.g. the last submitted answer, and interaction
rewards). Shaping (DAPO's overlong penalty) is a stage of its own (``rewards/shaping.py``) because validation reports
the unshaped score.
"""

from __future__ import annotations

from rlspmd.config import RewardConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.rewards import RewardManager
from rlspmd.roles.reward_model import RewardModel


class Reward:
    def __init__(self, cfg: RewardConfig, *, rules: RewardManager, model: RewardModel | None, agent: bool = False):
        """``agent``: the rollouts are multi-turn conversations whose batches carry ``agent_rewards_B``."""
        self.cfg, self.rules, self.model, self.agent = cfg, rules, model, agent
        self.components: tuple[tuple[str, str], ...] = (("task_scores_B", "task_score"),) + (
            (("rm_scores_B", "rm_score"),) if model is not None else ()
        ) + ((("agent_rewards_B", "agent"),) if agent else ())
        """(batch field, metric name) of the reward's parts, which the step reports as ``reward/<name>``."""

    def score(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        """Adds ``response_text``, ``task_scores_B``, ``rm_scores_B`` (with a reward model) and ``scores_B``."""
        batch = self.rules.score(batch)
        for k, v in self.rules.metrics().items():  # reward/timeouts of this rank, summed over ranks
            metrics.sum(k, v)
        scores = self.cfg.rule_weight * batch["task_scores_B"]
        if self.model is not None:
            batch = self.model(batch)
            scores = scores + self.cfg.model.weight * batch["rm_scores_B"]
        if self.agent:
            scores = scores + self.cfg.agent_weight * batch["agent_rewards_B"]
        return batch.set(scores_B=scores)

    def close(self) -> None:
        """Stop the reward worker processes."""
        self.rules.close()


class NoReward:
    """The rollout-only ranks of a split placement: their batches are empty; scoring happens on the actor's ranks."""

    components: tuple[tuple[str, str], ...] = ()

    def score(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch

    def close(self) -> None:
        pass
