"""The reward role: rule / function scores (``rewards/manager.py``) and, when configured, a reward model
(``roles/reward_model.py``), combined as ``scores_B = reward.rule_weight * task_scores_B + reward.model.weight *
rm_scores_B``; with multi-turn rollouts (``rollout.agent``) also ``+ reward.agent_weight * agent_rewards_B`` (the
rollout's tool reward deltas, the tools' scores of their final states, e.g. the last submitted answer, and interaction
rewards). Shaping (DAPO's overlong penalty) is a stage of its own (``rewards/shaping.py``) because validation reports
the unshaped score.

Reward components (GDPO, ``algorithm.adv_estimator=gdpo``): every scored batch also carries
``reward_components_BK``, one column per reward, in a fixed order: the rule / function score (``task_score``), the
reward model's score when there is one (``rm_score``), the agent's rewards with multi-turn rollouts (``agent``), then
each function of ``reward.components`` (same signature as ``reward.function``). Each component function is scored by
a ``RewardManager`` of its own (the same time limit, worker pool and error messages as ``reward.function``) and
logged as ``reward/component/<function name>``.
Simplification: each component decodes the responses again (a tokenizer call per component and batch).
"""

from __future__ import annotations

import dataclasses

import torch

from rlspmd.config import RewardConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.rewards import RewardManager
from rlspmd.rewards.functions import spec_name
from rlspmd.roles.reward_model import RewardModel


def component_columns(cfg: RewardConfig, *, agent: bool = False) -> list[str]:
    """The names of ``reward_components_BK``'s columns, in order (what ``GDPO.reward_weights`` weighs);
    ``agent``: multi-turn rollouts (``rollout.agent``), whose rewards are a column."""
    return (
        ["task_score"]
        + (["rm_score"] if cfg.model.path is not None else [])
        + (["agent"] if agent else [])
        + [spec_name(s) for s in cfg.components]
    )


def component_manager(cfg: RewardConfig, spec: str, tokenizer) -> RewardManager:
    """A manager that scores every sample with the component function ``spec`` (``reward.function``'s machinery)."""
    return RewardManager(dataclasses.replace(cfg, function=spec, rule_weight=1.0), tokenizer)


class Reward:
    def __init__(
        self,
        cfg: RewardConfig,
        *,
        rules: RewardManager,
        model: RewardModel | None,
        agent: bool = False,
        extra: dict[str, RewardManager] | None = None,
    ):
        """``agent``: the rollouts are multi-turn conversations whose batches carry ``agent_rewards_B``. ``extra``: the
        managers of ``reward.components`` by function name, in the config's order (``component_manager``)."""
        self.cfg, self.rules, self.model, self.agent = cfg, rules, model, agent
        self.extra = dict(extra or {})
        self.components: tuple[tuple[str, str], ...] = (
            (("task_scores_B", "task_score"),)
            + ((("rm_scores_B", "rm_score"),) if model is not None else ())
            + ((("agent_rewards_B", "agent"),) if agent else ())
        )
        """(batch field, metric name) of the reward's parts, which the step reports as ``reward/<name>``."""

    def score(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        """Adds ``response_text``, ``task_scores_B``, ``rm_scores_B`` (with a reward model), ``scores_B`` and
        ``reward_components_BK`` (``component_columns``)."""
        batch = self.rules.score(batch)
        for k, v in self.rules.metrics().items():  # reward/timeouts of this rank, summed over ranks
            metrics.sum(k, v)
        scores = self.cfg.rule_weight * batch["task_scores_B"]
        columns = [batch["task_scores_B"]]
        if self.model is not None:
            batch = self.model(batch)
            scores = scores + self.cfg.model.weight * batch["rm_scores_B"]
            columns.append(batch["rm_scores_B"])
        if self.agent:
            scores = scores + self.cfg.agent_weight * batch["agent_rewards_B"]
            columns.append(batch["agent_rewards_B"])
        for name, manager in self.extra.items():
            # A shallow copy: the manager writes task_scores_B / response_text, which must stay the task's.
            column = manager.score(Batch(batch.tensors, batch.objects))["task_scores_B"]
            for k, v in manager.metrics().items():
                metrics.sum(k, v)
            metrics.mean(f"reward/component/{name}", column.sum(), len(batch))
            columns.append(column)
        return batch.set(scores_B=scores, reward_components_BK=torch.stack([c.float() for c in columns], dim=1))

    def close(self) -> None:
        """Stop the reward worker processes."""
        self.rules.close()
        for manager in self.extra.values():
            manager.close()


class NoReward:
    """The rollout-only ranks of a split placement: their batches are empty; scoring happens on the actor's ranks."""

    components: tuple[tuple[str, str], ...] = ()

    def score(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch

    def close(self) -> None:
        pass
