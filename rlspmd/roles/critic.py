"""Critic role: the PPO value model on a training engine. ``NoCritic`` stands in for critic-free algorithms.

``Critic.values`` adds ``values_BR`` (V(s_t) of each response position under the critic before this step's
update: GAE's input and the anchor of value clipping). ``Critic.update`` runs the shared PPO update loop
(``roles/base.py``) on the clipped value loss toward ``returns_BR``, normalised over the GLOBAL mini-batch exactly as
the policy loss is, so the gradient does not depend on the DP degree or micro-batch size.
"""

from __future__ import annotations

import torch

from rlspmd.algorithms import AggArgs, value_loss
from rlspmd.config import CriticConfig
from rlspmd.engines.base import TrainingEngine
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.roles.base import UpdatePlan, ppo_updates, record_updates
from rlspmd.distributed.micro_batches import forward_micro_batches


class Critic:
    def __init__(self, cfg: CriticConfig, *, engine: TrainingEngine, plan: UpdatePlan):
        self.cfg, self.engine, self.plan = cfg, engine, plan
        self.warmup_steps = cfg.warmup_steps

    @torch.no_grad()
    def values(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        R = batch["responses_BR"].shape[1]
        values_BR = forward_micro_batches(
            batch,
            lambda mb: self.engine.module(
                mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"], response_len=R
            ),
            micro_batch_size=self.cfg.values_micro_batch_size,
            max_tokens=self.cfg.values_max_tokens_per_micro_batch,
            mesh=self.engine.mesh,
        )
        return batch.set(values_BR=values_BR * batch["loss_mask_BR"])

    def update(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        steps = ppo_updates(self.engine, batch, lambda module, mb, agg: self._loss(module, mb, agg, metrics), self.plan)
        record_updates(steps, metrics, prefix="critic", loss_name="vf_loss", engine=self.engine)
        mask = batch["loss_mask_BR"].float()
        returns, values = batch["returns_BR"], batch["values_BR"]
        n_tok = mask.sum()
        # How well the rollout-time values predicted this step's returns (falls as the critic learns).
        metrics.mean("critic/value_mse", ((returns - values).square() * mask).sum(), n_tok)
        metrics.mean("critic/returns_mean", (returns * mask).sum(), n_tok)
        metrics.mean("critic/values_mean", (values * mask).sum(), n_tok)
        return batch

    def _loss(self, module, mb: Batch, agg: AggArgs, metrics: MetricBuffer) -> torch.Tensor:
        R = mb["responses_BR"].shape[1]
        values = module(mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"], response_len=R)
        mask = mb["loss_mask_BR"].float()
        loss, stats = value_loss(
            values, mb["values_BR"], mb["returns_BR"], mask, clip_range=self.cfg.cliprange_value, agg=agg
        )
        n_tok = mask.sum()
        metrics.mean("critic/vf_loss", loss.detach(), 0.0)
        metrics.mean("critic/vf_clip_frac", stats["vf_clip_frac"] * n_tok, n_tok)
        return loss


class NoCritic:
    """Critic-free algorithms (GRPO family, RLOO, REINFORCE++, ...): every call does nothing."""

    warmup_steps = 0

    def values(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch

    def update(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch
