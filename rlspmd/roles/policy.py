"""The policy (actor) and the frozen reference: small classes over a training engine (``engines/base.py``).

``Policy.update`` runs the shared PPO update loop (``roles/base.py: ppo_updates``) with the policy loss; the
gradient does not depend on how the batch is split over ranks or micro-batches (global loss normalisation).

Old log-probs (``OldLogProbs``, decided by the builder): ``Policy.old_log_prob`` recomputes the behaviour policy's
log-probs under the trainer's numerics (``recompute``); or, when the step's one update runs the behaviour policy
itself, leaves them to the update's own forward (``update``: detached, ratio 1, same loss and gradient, one forward
fewer); or, in bypass mode, takes the rollout engine's (``rollout``: PPO's ratio is then pi_theta / pi_rollout).

Rollout correction (``algorithm.rollout_correction``, `rlspmd.roles.rollout_correction`): with recomputed old
log-probs the trainer's correction stage has already put ``rollout_is_weights_BR`` on the batch and taken the rejected
tokens out of ``loss_mask_BR``; otherwise the loss computes the correction itself, against the current policy's
detached log-probs (``policy_gradient_inputs``).

Mixture-of-experts models (``roles/moe.py``, held as ``moe``): the passes replay routing (R2 / R3), the old-log-prob
pass returns what it routed, and the update adds the router's load-balancing loss.
"""

from __future__ import annotations

import warnings
from typing import Literal, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.algorithms import AggArgs, entropy_bonus, kl_penalty
from rlspmd.config import ActorConfig, RefConfig
from rlspmd.engines.base import TrainingEngine
from rlspmd.models.logprobs import SUM_P2
from rlspmd.metrics import MetricBuffer
from rlspmd.models.vision import vision_inputs
from rlspmd.protocol import Batch
from rlspmd.roles.base import UpdatePlan, ppo_updates, record_updates
from rlspmd.roles.moe import MoEActor, NoMoE
from rlspmd.distributed.micro_batches import forward_micro_batches
from rlspmd.roles.rollout_correction import ResolvedRolloutCorrection, record_correction_metrics


class LossTerm(Protocol):
    """A further term of the policy loss with inputs of its own to the policy's forward (``roles/teacher.py``)."""

    def inputs(self, mb: Batch) -> dict:
        """Keyword arguments of the policy module's forward on ``mb`` (its third output then holds the term's)."""

    def add(self, loss: torch.Tensor, outputs: dict, logp_BR: torch.Tensor, mb: Batch, *, agg: AggArgs, metrics):
        """``loss`` plus the term, from the forward's third output ``outputs`` (``{}`` when the forward gave none)."""


class NoLossTerm:
    """No further term: the forward gets no extra inputs, the loss is unchanged."""

    def inputs(self, mb: Batch) -> dict:
        return {}

    def add(self, loss: torch.Tensor, outputs: dict, logp_BR: torch.Tensor, mb: Batch, *, agg, metrics):
        return loss


OldLogProbs = Literal["recompute", "update", "rollout"]
"""Where the update's old log-probs come from: a forward after generation (``actor.old_log_prob``), the update's own
forward (one update per step), or the rollout engine (bypass mode)."""


@torch.no_grad()
def compute_logprobs(
    module,
    batch: Batch,
    *,
    micro_batch_size: int,
    temperature: float,
    with_entropy: bool = False,
    max_tokens: int | None = None,
    mesh: DeviceMesh | None = None,
    moe: MoEActor | NoMoE = NoMoE(),
    extras: tuple[str, ...] = (),
):
    """Per-token log-probs (and entropy) of ``responses_BR`` under ``module``, micro-batch by micro-batch; with
    ``extras`` (per-token outputs of the log-prob kernel, ``rlspmd.models.logprobs``) also one ``(B, R)`` tensor each.

    ``max_tokens`` forms micro-batches by token budget instead (``split_micro_batches``; collective over ``mesh``).
    ``moe`` (a MoE actor's ``MoEActor``): replay its routing, and also return the routing the forwards used and the
    router's own, ``(B, L, N, K)`` each (``models/moe.py: RoutingState.routed_BL``).
    """
    R = batch["responses_BR"].shape[1]

    def forward(mb: Batch):
        out = module(
            mb["input_ids_BL"],
            mb["attention_mask_BL"],
            mb["position_ids_BL"],
            response_len=R,
            temperature=temperature,
            with_entropy=with_entropy,
            **vision_inputs(mb),
            **moe.replay(mb, update=False),
            **({"extras": extras} if extras else {}),  # an engine without vocabulary outputs is called as before
        )
        if extras:
            out = (out[0], out[1], *(out[2][k] for k in extras))
        if not moe.routing:
            return out
        used, own = module.moe.routed_BL()
        return (*out, used, own)

    out = forward_micro_batches(batch, forward, micro_batch_size=micro_batch_size, max_tokens=max_tokens, mesh=mesh)
    if not moe.routing:
        return out
    *outs, used, own = out
    return (*outs, used.to(torch.int16), own.to(torch.int16))


def logprob_gap(batch: Batch, old_logprobs_BR: torch.Tensor, metrics: MetricBuffer) -> None:
    """``rollout/logprob_gap``: mean |rollout - trainer| log-prob of the sampled tokens (stale weights show here)."""
    mask = batch["loss_mask_BR"].float()
    metrics.mean(
        "rollout/logprob_gap", ((batch["rollout_logprobs_BR"] - old_logprobs_BR).abs() * mask).sum(), mask.sum()
    )


def policy_gradient_inputs(
    mb: Batch,
    logp_BR: torch.Tensor,
    mask_BR: torch.Tensor,
    *,
    old_logprobs: OldLogProbs,
    correction: ResolvedRolloutCorrection | None,
    metrics: MetricBuffer,
):
    """``(old_logprobs_BR, mask_BR, weights_BR)`` for the policy loss of micro-batch ``mb``, rollout correction applied.

    ``logp_BR``: the update's log-probs of the sampled tokens (detached here). ``mask_BR``: the response mask.
    ``correction`` None: batches built without one (tools and tests that train on a batch they made): trained as
    given, no weights.

    * ``recompute``: the step's correction stage ran once against the recomputed old log-probs: its weights
      (``rollout_is_weights_BR``) and its mask (already in ``mb``, and so in the loss denominators) are used as they
      are.
    * ``update``: pi_train is the update's own forward (the step's single update runs the behaviour policy): the
      correction is computed here against ``logp_BR``, its metrics recorded, and its weights and mask returned; the
      denominators stay those of the uncorrected mask (as TRL and verl do when they correct inside the loss).
    * ``rollout`` (bypass): the old log-probs are the engine's, so PPO's ratio pi_theta / pi_rollout already carries the
      importance weight; only the rejection mask applies (weights would count the ratio twice, verl's bypass mode).
    """
    if correction is None:
        assert old_logprobs != "rollout", "bypass mode needs a rollout correction"
        if old_logprobs == "recompute":
            return mb["old_logprobs_BR"], mask_BR, None
        logprob_gap(mb, logp_BR.detach(), metrics)
        return logp_BR.detach(), mask_BR, None
    if old_logprobs == "recompute":
        return mb["old_logprobs_BR"], mask_BR, mb["rollout_is_weights_BR"]
    train_BR = logp_BR.detach()
    corrected = correction.apply(train_BR, mb["rollout_logprobs_BR"], mask_BR)
    record_correction_metrics(corrected, metrics)
    logprob_gap(mb, train_BR, metrics)
    if old_logprobs == "update":
        return train_BR, corrected.mask_BT, corrected.weights_BT
    return mb["old_logprobs_BR"], corrected.mask_BT, None


class Policy:
    def __init__(
        self,
        cfg: ActorConfig,
        *,
        engine: TrainingEngine,
        plan: UpdatePlan,
        temperature: float,
        correction: ResolvedRolloutCorrection | None = None,
        old_logprobs: OldLogProbs = "recompute",
        seed: int = 0,
        moe: MoEActor | NoMoE = NoMoE(),
        sum_pi_squared: bool = False,
        loss_term: LossTerm | None = None,
    ):
        """``old_logprobs``: where the old log-probs come from (the builder decided: ``update`` and ``rollout`` need one
        update per step). ``correction``: the resolved rollout correction (the trainer always has one; None trains on
        batches as given, for tools and tests). ``seed``: Clip-Cov's token draws (offset per DP rank). ``moe``: a MoE
        model's replay, load-balancing loss and routing metrics (``roles/moe.py``). ``sum_pi_squared``: the
        old-log-prob forward also gives ``sum_pi_squared_BR`` (the estimator reads it: OTB). ``loss_term``: a further
        term of the loss with inputs of its own to the forward (a teacher's GKD term)."""
        assert plan.single_update or old_logprobs == "recompute", f"old_logprobs={old_logprobs!r} needs a single update"
        assert not sum_pi_squared or old_logprobs == "recompute", "sum_pi_squared comes from the old-log-prob forward"
        self.cfg, self.engine, self.plan = cfg, engine, plan
        self.temperature = temperature
        self.old_logprobs, self.correction = old_logprobs, correction
        self.moe = moe
        self.old_extras = (SUM_P2,) if sum_pi_squared else ()
        self.loss_term = loss_term or NoLossTerm()
        # Clip-Cov draws its tokens with a generator of its own, seeded per DP rank
        self.loss_fn = cfg.policy_loss.build(
            generator=torch.Generator().manual_seed(seed + engine.mesh.get_local_rank())
        )

    def log_prob(self, batch: Batch) -> torch.Tensor:
        """``(B, R)`` log-probs of the sampled tokens under the current policy (no grad)."""
        return self._log_prob(batch)[0]

    def _log_prob(
        self, batch: Batch, extras: tuple[str, ...] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Log-probs, the kernel's ``extras`` (one ``(B, R)`` tensor each), and a MoE model's routing (used, own; empty
        for a dense model), replayed as ``actor.moe.router_replay`` says."""
        lp, _, *rest = compute_logprobs(
            self.engine.module,
            batch,
            micro_batch_size=self.cfg.logprob_micro_batch_size,
            temperature=self.temperature,
            max_tokens=self.cfg.logprob_max_tokens_per_micro_batch,
            mesh=self.engine.mesh,
            moe=self.moe,
            extras=extras,
        )
        return lp, rest[: len(extras)], rest[len(extras) :]

    def old_log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        if self.old_logprobs == "update":  # the update's forward provides them
            return batch
        if self.old_logprobs == "rollout":  # bypass: no forward at all
            return batch.set(old_logprobs_BR=batch["rollout_logprobs_BR"])
        old, more, routed = self._log_prob(batch, self.old_extras)
        batch = self.moe.routed(batch, routed, metrics)
        self.moe.flush(metrics)
        logprob_gap(batch, old, metrics)
        batch = batch.set(old_logprobs_BR=old)
        return batch.set(sum_pi_squared_BR=more[0]) if more else batch

    def update(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        steps = ppo_updates(self.engine, batch, lambda module, mb, agg: self._loss(module, mb, agg, metrics), self.plan)
        record_updates(steps, metrics, prefix="actor", loss_name="pg_loss", engine=self.engine)
        self.moe.flush(metrics)
        return batch

    def _loss(self, module, mb: Batch, agg: AggArgs, metrics: MetricBuffer) -> torch.Tensor:
        cfg = self.cfg
        R = mb["responses_BR"].shape[1]
        logp, entropy, *outputs = module(
            mb["input_ids_BL"],
            mb["attention_mask_BL"],
            mb["position_ids_BL"],
            response_len=R,
            temperature=self.temperature,
            **vision_inputs(mb),
            **self.moe.replay(mb, update=True),
            **self.loss_term.inputs(mb),
        )
        mask = mb["loss_mask_BR"].float()  # the model's own tokens: tool results and template glue do not count
        n_tok = mask.sum()
        old_logp, pg_mask, weights = policy_gradient_inputs(
            mb, logp, mask, old_logprobs=self.old_logprobs, correction=self.correction, metrics=metrics
        )
        pg_loss, pg_stats = self.loss_fn(
            logp,
            old_logp,
            mb["advantages_BR"],
            pg_mask,
            agg=agg,
            weights_BT=weights,
        )
        loss = pg_loss
        if cfg.use_kl_loss:
            kl = kl_penalty(logp, mb["ref_logprobs_BR"], kind=cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * agg(kl, mask)
            metrics.mean("actor/kl_loss", (kl.detach() * mask).sum(), n_tok)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy_bonus(entropy, mask, agg=agg)
        loss = loss + self.moe.loss_term(module, mb, agg, metrics)
        loss = self.loss_term.add(loss, outputs[0] if outputs else {}, logp, mb, agg=agg, metrics=metrics)
        metrics.mean("actor/entropy", (entropy.detach() * mask).sum(), n_tok)
        metrics.mean("actor/pg_loss", pg_loss.detach(), 0.0)
        for k, v in pg_stats.items():
            metrics.mean(f"actor/{k}", v * n_tok, n_tok)
        return loss


class Reference:
    """Frozen copy of the initial policy; adds ``ref_logprobs_BR``."""

    def __init__(self, cfg: RefConfig, *, engine: TrainingEngine, temperature: float, offload: bool):
        """``offload``: keep the parameters in host memory between uses (the builder resolved ``ref.offload``)."""
        self.cfg, self.engine = cfg, engine
        self.temperature = temperature
        self.offload = offload
        if offload:
            self.engine.offload_params()

    def log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        if self.offload:
            self.engine.load_params()
        lp, _ = compute_logprobs(
            self.engine.module,
            batch,
            micro_batch_size=self.cfg.logprob_micro_batch_size,
            temperature=self.temperature,
            max_tokens=self.cfg.logprob_max_tokens_per_micro_batch,
            mesh=self.engine.mesh,
        )
        if self.offload:
            self.engine.offload_params()
        return batch.set(ref_logprobs_BR=lp)


def resolve_ref_offload(cfg: RefConfig, *, device: torch.device, cpu_offload: bool) -> bool:
    """``ref.offload`` where it does something: on CUDA, unless FSDP already keeps the parameters on the host."""
    if cfg.offload and (device.type != "cuda" or cpu_offload):
        warnings.warn(
            "ref.offload does nothing here: the reference's parameters already live in host memory "
            f"(device {device.type}, actor.engine.cpu_offload={cpu_offload})",
            stacklevel=2,
        )
        return False
    return cfg.offload


class NoReference:
    """Stands in when no KL term needs the reference: does nothing."""

    def log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch


class NoPolicy:
    """The rollout-only ranks of a split placement: the policy trains elsewhere."""

    def old_log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch

    def update(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch
