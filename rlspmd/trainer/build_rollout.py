"""The builder's rollout: what one sample is (a single turn or an agent conversation), the rollout role of this rank
(colocated, or either side of a split placement) on the engine ``rollout.engine`` builds, and the rollout correction
resolved from the run's facts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlspmd.agent import build_agent_loop
from rlspmd.agent.loop import AgentLoop
from rlspmd.config import Config, RolloutConfig
from rlspmd.distributed.mesh import RoleMeshes
from rlspmd.models.loader import DTYPES, dtype_name
from rlspmd.protocol import Batch
from rlspmd.roles.policy import Policy
from rlspmd.roles.rollout import Rollout, RolloutClient, RolloutRole, RolloutServer, SingleTurn
from rlspmd.roles.rollout_correction import ResolvedRolloutCorrection, resolve_rollout_correction
from rlspmd.rollout.weight_sync import WeightBridge
from rlspmd.rollout.weights import BridgedWeights, InPlaceWeights, StreamedWeights


def rollout_dtype(cfg: RolloutConfig, *, compute: torch.dtype) -> torch.dtype:
    """The rollout's weight dtype: ``rollout.dtype``, ``auto`` being the actor's compute dtype."""
    return compute if cfg.dtype == "auto" else DTYPES[cfg.dtype]


def build_episodes(
    cfg: RolloutConfig, *, tokenizer, eos_ids: list[int], pad_id: int, model_field: str
) -> SingleTurn | AgentLoop:
    """What one sample is: a single response, or a multi-turn conversation with tools (``rollout.agent``), whose tools,
    parser, interaction and chat template are checked here, at start-up."""
    if not cfg.agent.enabled:
        return SingleTurn()
    return build_agent_loop(
        cfg.agent,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        pad_id=pad_id,
        max_response_length=cfg.max_response_length,
        model_field=model_field,
    )


def build_rollout(
    cfg: RolloutConfig,
    *,
    meshes: RoleMeshes,
    policy: Policy | None,
    model_path: str,
    compute: torch.dtype,
    eos_ids: list[int],
    pad_id: int,
    device: torch.device,
    seed: int,
    max_prompt_length: int,
    in_place_capable: bool = True,
    episodes: SingleTurn | AgentLoop | None = None,
    max_staleness: int = 0,
    draw: Callable[[], Batch] | None = None,
) -> RolloutRole:
    """The rollout role for this rank: ``Rollout`` (colocated), ``RolloutClient`` (split, actor ranks) or
    ``RolloutServer`` (split, rollout ranks, where ``policy`` is None). ``in_place_capable``: the actor's engine can
    lend its gathered weights (FSDP2 without ``mesh.actor_tp``; a megatron actor streams them). ``episodes``: single- or
    multi-turn samples (``build_episodes``); they run where generation runs (in split placement, tools run on the
    rollout ranks). ``max_staleness`` (split only): how many steps ahead the rollout ranks generate; ``draw``: the actor
    ranks' next prompts, which fill that pipeline. Collective: weight-stream manifests are local, but a vLLM engine's
    construction spans the whole world."""
    dims = meshes.dims
    dtype = rollout_dtype(cfg, compute=compute)
    kw = dict(
        model_path=model_path,
        dtype=dtype,
        tp=dims.role_tp["rollout"],
        eos_ids=eos_ids,
        pad_id=pad_id,
        device=device,
        max_model_len=max_prompt_length + cfg.max_response_length,
    )
    if not dims.disjoint("actor", "rollout"):
        in_place = cfg.engine.reads_in_place and dtype == compute and in_place_capable
        weights = InPlaceWeights(policy.engine) if in_place else StreamedWeights(policy.engine.weight_stream(dtype))
        engine = cfg.engine.build(weights=weights, sleeps=True, seed=seed + meshes.dp_rank("rollout"), **kw)
        return Rollout(
            cfg, engine=engine, weights=weights, mesh=meshes.get("rollout"), seed=seed, device=device, episodes=episodes
        )
    link = meshes.link("actor", "rollout")
    bridge = WeightBridge(
        meshes.link("actor", "rollout", first_only=True), src=dims.role_ranks["actor"][0], device=device
    )
    rollout_ranks = dims.role_ranks["rollout"]
    if policy is not None:
        return RolloutClient(
            link=link,
            bridge=bridge,
            stream=policy.engine.weight_stream(dtype),
            rollout_ranks=rollout_ranks,
            device=device,
            lag=max_staleness,
            draw=draw,
        )
    weights = BridgedWeights(bridge)
    engine = cfg.engine.build(weights=weights, sleeps=False, seed=seed + meshes.dp_rank("rollout"), **kw)
    local = Rollout(
        cfg,
        engine=engine,
        weights=weights,
        mesh=meshes.get("rollout"),
        seed=seed,
        device=device,
        syncs_itself=False,
        episodes=episodes,
    )
    return RolloutServer(local, link=link, rollout_ranks=rollout_ranks, lag=max_staleness)


def build_rollout_correction(cfg: Config, *, compute: torch.dtype, split: bool) -> ResolvedRolloutCorrection:
    """``algorithm.rollout_correction`` resolved from the facts of this run (engine, rollout and actor dtypes,
    placement, staleness). Bypass mode's conditions on the resolution are checked by ``rlspmd.validate`` (which resolves
    it the same way) before anything loads."""
    return resolve_rollout_correction(
        cfg.algorithm.rollout_correction,
        engine=cfg.rollout.engine,
        rollout_dtype=cfg.rollout.dtype,
        actor_compute_dtype=dtype_name(compute),
        placement="split" if split else "colocated",
        max_staleness=cfg.trainer.max_staleness,
    )
