"""The actor's mixture-of-experts duties: routing replay (R2 / R3), the load-balancing loss, the routing metrics.

The policy role (``roles/policy.py``) holds one of two objects, chosen by the builder from the model: ``MoEActor``
for a MoE model (``models/moe.py``), ``NoMoE`` (does nothing) for a dense one, so the policy's passes have no branch
on the architecture.

Replay (``actor.moe.router_replay``; verl ``router_replay``, NeMo-RL router replay, slime
``--use-rollout-routing-replay``):

* ``off``: every forward routes with the current router.
* ``R2``: the old-log-prob pass routes freely and its choices (``old_routing_BL``) are replayed in the update, so the
  PPO ratio compares the same experts' outputs (the update's weights move the router, which would otherwise reroute
  tokens between the two passes). Needs that pass (the builder recomputes the old log-probs).
* ``R3``: the rollout engine's choices (``rollout_routing_BL``, recorded with the sample by the native engine) are
  replayed in the old-log-prob pass and in the update: training routes every token as generation did, which removes
  the routing part of the rollout-training mismatch (the largest part in MoE RL).

In every replay the gate weights are the current router's probabilities at the replayed experts (renormalised as
the model does), so the router keeps its gradient.

Metrics (from the first actor pass of the step: the old-log-prob pass, or the update when it provides the old
log-probs): ``moe/routing_agreement``, the share of (token, layer) pairs whose experts in the trainer's forward are
the rollout's set (1.0 under R3); ``moe/router_agreement``, the same for the trainer router's own top-k (what the
mismatch would be without replay); ``moe/expert_load`` (max over mean tokens per expert, the worst layer; 1.0 is
perfect balance) and ``moe/expert_load_mean`` (averaged over layers); ``actor/moe_aux_loss`` in the update. The
rollout-training mismatch KL is the rollout correction's ``mismatch/kl_k1`` / ``kl_k3``.

The load-balancing loss is the model's (``RoutingState.aux_loss``) per micro-batch, weighted by the micro-batch's
share of the mini-batch's loss tokens, times ``actor.moe.aux_loss_coef`` (default: the model's
``router_aux_loss_coef``): summed over micro-batches and ranks, a token-weighted mean of the micro-batches' losses.
"""

from __future__ import annotations

import torch

from rlspmd.algorithms import AggArgs
from rlspmd.algorithms.moe import expert_counts, same_expert_set
from rlspmd.config import MoEConfig
from rlspmd.distributed.dispatch import all_reduce_sum
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch

ROLLOUT_ROUTING = "rollout_routing_BL"
"""The batch field of the rollout engine's routing, ``(B, L, N, K)`` int16, ``-1`` where unknown."""
OLD_ROUTING = "old_routing_BL"
"""The old-log-prob pass's routing (R2)."""


class NoMoE:
    """A dense actor: no replay, no auxiliary loss, no routing metrics."""

    routing = False

    def replay(self, batch: Batch, *, update: bool) -> dict:
        return {}

    def routed(self, batch: Batch, routing: list, metrics: MetricBuffer) -> Batch:
        return batch

    def loss_term(self, module, mb: Batch, agg: AggArgs, metrics: MetricBuffer) -> float:
        return 0.0

    def flush(self, metrics: MetricBuffer) -> None:
        pass


class MoEActor:
    routing = True
    """The policy's log-prob pass returns the routing (for ``routed``)."""

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        model_aux_loss_coef: float,
        num_experts: int,
        rollout_routing: bool,
        metrics_in_update: bool,
        mesh,
    ):
        """``rollout_routing``: the rollout engine records ``rollout_routing_BL`` (needed by R3 and the agreement
        metrics). ``metrics_in_update``: the update provides the old log-probs (no separate pass), so it records the
        routing metrics. ``mesh``: the actor's DP mesh (the load's counts are summed over it)."""
        assert cfg.router_replay != "R3" or rollout_routing, "validate: R3 needs the rollout's routing"
        assert cfg.router_replay != "R2" or not metrics_in_update, "the builder recomputes the old log-probs for R2"
        self.cfg = cfg
        self.coef = model_aux_loss_coef if cfg.aux_loss_coef is None else cfg.aux_loss_coef
        self.num_experts = num_experts
        self.rollout_routing = rollout_routing
        self.metrics_in_update = metrics_in_update
        self.mesh = mesh
        self._counts: torch.Tensor | None = None

    def replay(self, batch: Batch, *, update: bool) -> dict:
        """The policy forward's ``replay_BL`` keyword for a log-prob pass (``update`` False) or the update."""
        mode = self.cfg.router_replay
        if mode == "R3":
            return {"replay_BL": batch[ROLLOUT_ROUTING]}
        if mode == "R2" and update:
            return {"replay_BL": batch[OLD_ROUTING]}
        return {}

    def routed(self, batch: Batch, routing: list[torch.Tensor], metrics: MetricBuffer) -> Batch:
        """After the old-log-prob pass (``routing``: the ``(used_BL, own_BL)`` it returned): record the metrics, keep
        the routing for R2."""
        used_BL, own_BL = routing
        self._record(batch, used_BL, own_BL, metrics)
        return batch.set(**{OLD_ROUTING: used_BL.to(torch.int16)}) if self.cfg.router_replay == "R2" else batch

    def _record(self, batch: Batch, used_BL: torch.Tensor, own_BL: torch.Tensor, metrics: MetricBuffer) -> None:
        valid_BL = batch["attention_mask_BL"] > 0
        if self.rollout_routing:
            rollout = batch[ROLLOUT_ROUTING].to(used_BL.device)
            known = valid_BL[..., None] & (rollout[..., 0] >= 0)  # (B, L, N): tokens the rollout ran
            count = known.sum().double()
            metrics.mean("moe/routing_agreement", (same_expert_set(used_BL, rollout) & known).sum().double(), count)
            metrics.mean("moe/router_agreement", (same_expert_set(own_BL, rollout) & known).sum().double(), count)
        counts = expert_counts(used_BL[valid_BL].long(), num_experts=self.num_experts)
        self._counts = counts if self._counts is None else self._counts + counts

    def loss_term(self, module, mb: Batch, agg: AggArgs, metrics: MetricBuffer) -> torch.Tensor:
        """The micro-batch's share of the load-balancing loss (after the policy module's forward on ``mb``)."""
        state = module.moe
        aux = state.aux_loss()
        n_tok = mb["loss_mask_BR"].sum().double()
        metrics.mean("actor/moe_aux_loss", aux.detach().double() * n_tok, n_tok)
        if self.metrics_in_update:
            used, own = state.routed_BL()
            self._record(mb, used, own, metrics)
        return self.coef * aux * (n_tok / max(float(agg.global_tokens), 1.0)).to(aux.dtype)

    def flush(self, metrics: MetricBuffer) -> None:
        """The expert load of the pass just run, over all DP ranks (one all-reduce; every actor rank calls it)."""
        if self._counts is None:
            return
        counts = all_reduce_sum(self._counts, mesh=self.mesh)
        self._counts = None
        load = counts.max(-1).values / counts.mean(-1).clamp(min=1e-9)  # per layer
        metrics.max("moe/expert_load", load.max())
        metrics.max("moe/expert_load_mean", load.mean())


def config_problems(cfg, *, check_files: bool) -> list[tuple[str, object, str]]:
    """The MoE settings of an RL ``Config`` (``actor.moe``, ``mesh.actor_ep``) against the rest of the run and, when
    files are checked, the model's ``config.json``: ``(field, value, why)`` for ``rlspmd.validate``."""
    import json
    from pathlib import Path

    from rlspmd.models.moe import MOE_MODEL_TYPES

    out = [(f"actor.moe.{name}", value, why) for name, value, why in cfg.actor.moe.problems()]
    ep, replay = cfg.mesh.actor_ep, cfg.actor.moe.router_replay
    if ep > 1:
        if not cfg.actor.engine.supports_moe:
            out.append(
                (
                    "mesh.actor_ep",
                    ep,
                    f"is the fsdp engine's expert parallelism, not actor.engine:{cfg.actor.engine.name}'s",
                )
            )
        if cfg.actor.lora.enabled:
            out.append(("mesh.actor_ep", ep, "is not supported with actor.lora; use actor_ep=1"))
    if replay == "R3" and not cfg.rollout.engine.records_routing:
        out.append(
            (
                "actor.moe.router_replay",
                replay,
                "R3 replays the routing the rollout engine records with each sample: "
                f"rollout.engine:{cfg.rollout.engine.name} does not record it (the native engine does; vLLM 0.32's "
                "CPU build cannot return it, docs/moe.md)",
            )
        )
    if replay == "R3" and cfg.rollout.agent.enabled:
        out.append(
            (
                "actor.moe.router_replay",
                replay,
                "R3 is not supported with rollout.agent (multi-turn samples are "
                "generated request by request and their routing is not recorded)",
            )
        )
    config_json = Path(cfg.actor.model.path).expanduser() / "config.json"
    if not (check_files and config_json.is_file()):
        return out
    c = json.loads(config_json.read_text())
    model_type = c.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        if ep > 1:
            out.append(
                (
                    "mesh.actor_ep",
                    ep,
                    f"the model ({config_json}: model_type={model_type!r}) is not a "
                    f"mixture-of-experts model rlspmd runs ({sorted(MOE_MODEL_TYPES)})",
                )
            )
        if replay != "off":
            out.append(
                (
                    "actor.moe.router_replay",
                    replay,
                    f"the model ({config_json}: model_type={model_type!r}) has no mixture-of-experts layers to replay",
                )
            )
        return out
    experts = c.get("num_experts", c.get("num_local_experts"))
    if ep > 1 and isinstance(experts, int) and experts % ep:
        out.append(("mesh.actor_ep", ep, f"must divide the model's {experts} experts ({config_json})"))
    if not cfg.actor.engine.supports_moe:
        out.append(
            (
                "actor.engine",
                cfg.actor.engine.name,
                f"a mixture-of-experts model ({model_type}) trains on the "
                "fsdp engine only (megatron-core's MoE path is not wired in: docs/moe.md)",
            )
        )
    return out
