"""The policy (actor) and the frozen reference: small classes over the shared FSDP2 engine.

``Policy.update`` runs PPO epochs × mini-batches × micro-batches. Loss normalisation is global: before
each mini-batch the valid-token and sequence counts are summed over the DP mesh, every micro-batch loss
is divided by those global counts, and gradients are summed over ranks (``engines/fsdp.py``). The
gradient therefore does not depend on how the mini-batch is split over ranks or micro-batches.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.algorithms import AGG_MODES, POLICY_LOSSES, AggArgs, entropy_bonus, kl_penalty
from rlspmd.config import ActorConfig, RefConfig
from rlspmd.distributed.dispatch import MetricBuffer
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.engines.micro_batches import forward_micro_batches, mini_batch_updates
from rlspmd.models.loader import load_causal_lm
from rlspmd.models.packing import training_attn_implementation
from rlspmd.models.policy import CausalLMPolicy
from rlspmd.protocol import Batch


@torch.no_grad()
def compute_logprobs(
    module, batch: Batch, *, micro_batch_size: int, temperature: float, with_entropy: bool = False,
    max_tokens: int | None = None, mesh: DeviceMesh | None = None,
):
    """Per-token log-probs (and entropy) of ``responses_BR`` under ``module``, micro-batch by micro-batch.

    ``max_tokens`` forms micro-batches by token budget instead (``split_micro_batches``; collective over ``mesh``).
    """
    R = batch["responses_BR"].shape[1]
    return forward_micro_batches(
        batch,
        lambda mb: module(
            mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"],
            response_len=R, temperature=temperature, with_entropy=with_entropy,
        ),
        micro_batch_size=micro_batch_size, max_tokens=max_tokens, mesh=mesh,
    )


def build_policy_module(
    model_path: str, *, dtype: str, attn_implementation: str, field_name: str, packing: bool = False
) -> CausalLMPolicy:
    attn = training_attn_implementation(attn_implementation, packing=packing, field_name="model.attn_implementation")
    return CausalLMPolicy(load_causal_lm(model_path, dtype=dtype, attn_implementation=attn, field_name=field_name), packing=packing)


class Policy:
    def __init__(
        self,
        cfg: ActorConfig,
        *,
        mesh: DeviceMesh,
        device: torch.device,
        samples_per_prompt: int,
        train_batch_size: int,
        temperature: float,
        max_response_length: int,
        total_steps: int,
    ):
        self.cfg = cfg
        self.mesh = mesh
        self.temperature = temperature
        self.max_response_length = max_response_length
        dp = mesh.size()
        rows = cfg.mini_batch_size * samples_per_prompt
        if rows % dp:
            raise ValueError(
                f"actor.mini_batch_size={cfg.mini_batch_size} x rollout.n={samples_per_prompt} = {rows} samples "
                f"do not split over {dp} DP ranks"
            )
        self.local_mini_batch = rows // dp
        self.single_update = cfg.ppo_epochs == 1 and cfg.mini_batch_size == train_batch_size
        if train_batch_size % cfg.mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={train_batch_size} is not a multiple of actor.mini_batch_size={cfg.mini_batch_size}"
            )
        optim_steps = total_steps * cfg.ppo_epochs * (train_batch_size // cfg.mini_batch_size)
        if cfg.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"actor.policy_loss={cfg.policy_loss!r} is not one of {sorted(POLICY_LOSSES)}")
        self.loss_fn = POLICY_LOSSES[cfg.policy_loss]
        if cfg.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode={cfg.loss_agg_mode!r} is not one of {sorted(AGG_MODES)}")
        if cfg.sapo_tau_pos <= 0 or cfg.sapo_tau_neg <= 0:
            raise ValueError(f"actor.sapo_tau_pos / sapo_tau_neg must be > 0, got {cfg.sapo_tau_pos}, {cfg.sapo_tau_neg}")
        module = build_policy_module(
            cfg.model.path, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
            field_name="actor.model.path", packing=cfg.model.packing,
        )
        self.engine = FSDPEngine(
            module,
            module.hf,
            mesh=mesh,
            device=device,
            fsdp=cfg.fsdp,
            optim=cfg.optim,
            total_optim_steps=optim_steps,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
        )

    def log_prob(self, batch: Batch) -> Batch:
        """Adds ``old_logprobs_BR``: the behaviour policy's log-probs, recomputed by the trainer's numerics."""
        lp, _ = compute_logprobs(
            self.engine.module, batch, micro_batch_size=self.cfg.logprob_micro_batch_size, temperature=self.temperature,
            max_tokens=self.cfg.logprob_max_tokens_per_micro_batch, mesh=self.mesh,
        )
        return batch.set(old_logprobs_BR=lp)

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
            metrics.mean("actor/grad_norm", stats["grad_norm"] / dp, 1 / dp)
            metrics.sum("actor/skipped_updates", stats["skipped"] / dp)
            metrics.mean("actor/pg_loss", 0.0, 1 / dp)  # one global loss per optimiser step
        metrics.max("actor/lr", self.engine.lr)
        return metrics

    def _loss(self, module, mb: Batch, agg: AggArgs, metrics: MetricBuffer) -> torch.Tensor:
        cfg = self.cfg
        R = mb["responses_BR"].shape[1]
        logp, entropy = module(
            mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"], response_len=R, temperature=self.temperature
        )
        mask = mb["response_mask_BR"].float()
        n_tok = mask.sum()
        if "old_logprobs_BR" in mb:
            old_logp = mb["old_logprobs_BR"]
        else:  # reuse_update_logprobs: the one update of the step runs the behaviour policy itself (ratio 1)
            old_logp = logp.detach()
            gap = ((mb["rollout_logprobs_BR"] - old_logp).abs() * mask).sum()
            metrics.mean("rollout/logprob_gap", gap, n_tok)
        pg_loss, pg_stats = self.loss_fn(
            logp,
            old_logp,
            mb["advantages_BR"],
            mask,
            agg=agg,
            clip_low=cfg.clip_ratio_low,
            clip_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            tau_pos=cfg.sapo_tau_pos,  # loss-specific options: SAPO reads them, the other losses ignore them
            tau_neg=cfg.sapo_tau_neg,
        )
        loss = pg_loss
        if cfg.use_kl_loss:
            kl = kl_penalty(logp, mb["ref_logprobs_BR"], kind=cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * agg(kl, mask)
            metrics.mean("actor/kl_loss", (kl.detach() * mask).sum(), n_tok)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy_bonus(entropy, mask, agg=agg)
        metrics.mean("actor/entropy", (entropy.detach() * mask).sum(), n_tok)
        metrics.mean("actor/pg_loss", pg_loss.detach(), 0.0)
        for k, v in pg_stats.items():
            metrics.mean(f"actor/{k}", float(v) * n_tok, n_tok)
        return loss


class Reference:
    """Frozen copy of the initial policy; adds ``ref_logprobs_BR``."""

    def __init__(self, cfg: RefConfig, *, model_path: str, dtype: str, attn_implementation: str, mesh: DeviceMesh, device: torch.device, fsdp, temperature: float, packing: bool = False):
        self.cfg = cfg
        self.temperature = temperature
        self.mesh = mesh
        module = build_policy_module(
            cfg.model_path or model_path, dtype=dtype, attn_implementation=attn_implementation, field_name="ref.model_path",
            packing=packing,
        )
        self.engine = FSDPEngine(module, module.hf, mesh=mesh, device=device, fsdp=fsdp, optim=None)
        self.offload = cfg.offload
        if cfg.offload and (device.type != "cuda" or fsdp.cpu_offload):
            warnings.warn("ref.offload does nothing here: the reference's parameters already live in host memory "
                          f"(device {device.type}, fsdp.cpu_offload={fsdp.cpu_offload})", stacklevel=2)
            self.offload = False
        if self.offload:
            self.engine.offload_params()

    def log_prob(self, batch: Batch) -> Batch:
        if self.offload:
            self.engine.load_params()
        lp, _ = compute_logprobs(
            self.engine.module, batch, micro_batch_size=self.cfg.logprob_micro_batch_size, temperature=self.temperature,
            max_tokens=self.cfg.logprob_max_tokens_per_micro_batch, mesh=self.mesh,
        )
        if self.offload:
            self.engine.offload_params()
        return batch.set(ref_logprobs_BR=lp)


class NoReference:
    """Stands in when no KL term needs the reference: does nothing."""

    def log_prob(self, batch: Batch) -> Batch:
        return batch
