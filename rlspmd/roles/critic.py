"""Critic role: the PPO value model on the shared FSDP2 engine. ``NoCritic`` stands in for critic-free algorithms.

``Critic.values`` adds ``values_BR`` (V(s_t) of each response position under the critic before this step's
update: GAE's input and the anchor of value clipping). ``Critic.update`` runs PPO epochs x mini-batches x
micro-batches of the clipped value loss toward ``returns_BR``, normalised over the GLOBAL mini-batch exactly as
the policy loss is (``roles/policy.py``), so the gradient does not depend on the DP degree or micro-batch size.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.algorithms import AggArgs, value_loss
from rlspmd.algorithms.aggregation import AGG_MODES
from rlspmd.config import CriticConfig
from rlspmd.distributed.dispatch import MetricBuffer
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.engines.micro_batches import forward_micro_batches, mini_batch_updates
from rlspmd.models.value import load_value_model
from rlspmd.protocol import Batch


class Critic:
    def __init__(
        self,
        cfg: CriticConfig,
        *,
        model_path: str,
        dtype: str,
        attn_implementation: str,
        mesh: DeviceMesh,
        device: torch.device,
        samples_per_prompt: int,
        train_batch_size: int,
        max_response_length: int,
        total_steps: int,
        seed: int,
        packing: bool = False,
    ):
        self.cfg, self.mesh = cfg, mesh
        self.max_response_length = max_response_length
        dp = mesh.size()
        rows = cfg.mini_batch_size * samples_per_prompt
        if rows % dp:
            raise ValueError(
                f"critic.mini_batch_size={cfg.mini_batch_size} x rollout.n={samples_per_prompt} = {rows} samples "
                f"do not split over {dp} DP ranks"
            )
        if train_batch_size % cfg.mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={train_batch_size} is not a multiple of critic.mini_batch_size={cfg.mini_batch_size}"
            )
        if cfg.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"critic.loss_agg_mode={cfg.loss_agg_mode!r} is not one of {sorted(AGG_MODES)}")
        if cfg.cliprange_value is not None and cfg.cliprange_value <= 0:
            raise ValueError(f"critic.cliprange_value must be > 0 or None, got {cfg.cliprange_value}")
        if cfg.warmup_steps < 0:
            raise ValueError(f"critic.warmup_steps must be >= 0, got {cfg.warmup_steps}")
        self.local_mini_batch = rows // dp
        module = load_value_model(
            cfg.model_path or model_path, dtype=dtype, attn_implementation=attn_implementation, seed=seed,
            field_name="critic.model_path" if cfg.model_path else "actor.model.path", packing=packing,
        )
        optim_steps = total_steps * cfg.ppo_epochs * (train_batch_size // cfg.mini_batch_size)
        self.engine = FSDPEngine(
            module, module.hf, mesh=mesh, device=device, fsdp=cfg.fsdp, optim=cfg.optim,
            total_optim_steps=optim_steps, gradient_checkpointing=cfg.gradient_checkpointing,
        )

    @property
    def warmup_steps(self) -> int:
        return self.cfg.warmup_steps

    @torch.no_grad()
    def values(self, batch: Batch) -> Batch:
        R = batch["responses_BR"].shape[1]
        values_BR = forward_micro_batches(
            batch, lambda mb: self.engine.module(mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"], response_len=R),
            micro_batch_size=self.cfg.values_micro_batch_size, max_tokens=self.cfg.values_max_tokens_per_micro_batch, mesh=self.mesh,
        )
        return batch.set(values_BR=values_BR * batch["response_mask_BR"])

    def update(self, batch: Batch) -> MetricBuffer:
        cfg, metrics = self.cfg, MetricBuffer()
        dp = self.mesh.size()
        steps = mini_batch_updates(
            self.engine, batch, lambda module, mb, agg: self._loss(module, mb, agg, metrics), epochs=cfg.ppo_epochs,
            local_mini_batch=self.local_mini_batch, micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_micro_batch, loss_agg_mode=cfg.loss_agg_mode,
            norm_length=self.max_response_length, mesh=self.mesh,
        )
        for stats in steps:
            metrics.mean("critic/grad_norm", stats["grad_norm"] / dp, 1 / dp)
            metrics.mean("critic/vf_loss", 0.0, 1 / dp)  # one global loss per optimiser step
        mask = batch["response_mask_BR"].float()
        returns, values = batch["returns_BR"], batch["values_BR"]
        n_tok = mask.sum()
        # How well the rollout-time values predicted this step's returns (falls as the critic learns).
        metrics.mean("critic/value_mse", ((returns - values).square() * mask).sum(), n_tok)
        metrics.mean("critic/returns_mean", (returns * mask).sum(), n_tok)
        metrics.mean("critic/values_mean", (values * mask).sum(), n_tok)
        metrics.max("critic/lr", self.engine.lr)
        return metrics

    def _loss(self, module, mb: Batch, agg: AggArgs, metrics: MetricBuffer) -> torch.Tensor:
        R = mb["responses_BR"].shape[1]
        values = module(mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"], response_len=R)
        mask = mb["response_mask_BR"].float()
        loss, stats = value_loss(
            values, mb["values_BR"], mb["returns_BR"], mask, clip_range=self.cfg.cliprange_value, agg=agg
        )
        n_tok = mask.sum()
        metrics.mean("critic/vf_loss", loss.detach(), 0.0)
        metrics.mean("critic/vf_clip_frac", float(stats["vf_clip_frac"]) * n_tok, n_tok)
        return loss


class NoCritic:
    """Critic-free algorithms (GRPO family, RLOO, REINFORCE++, ...): every call does nothing."""

    warmup_steps = 0

    def values(self, batch: Batch) -> Batch:
        return batch

    def update(self, batch: Batch) -> MetricBuffer:
        return MetricBuffer()
