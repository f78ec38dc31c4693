"""The builder: the one place that turns a ``Config`` into what each rank runs.

* **Which roles exist** follows from one rule, ``RolePlan.of(config)``: a critic for estimators that read values, a
  reference when a KL term needs it, a reward model when one is configured, a greedy baseline for ReMax.
* **Where they run**: the reference, critic and reward model live on the actor's ranks; the rollout shares them
  (colocated) or has ranks of its own (split). The config (placement, sizes, files) was checked before this runs
  (``rlspmd/validate.py``, on every rank, before anything loads).
* **What a rank holds** (``Roles``): on the actor's ranks the real roles; on the rollout-only ranks of a split
  placement, objects that do nothing except serve the rollout (``RolloutServer``), so every rank runs the same step.
* Models are built, then parallelised by the engine (``engines/fsdp.py``; a megatron module is built split and handed
  to ``engines/megatron``), then handed to the role that uses them.
  The tokenizer is loaded once.
* **What a checkpoint holds** is named here (``Checkpointing``): the trained engines and the trainer components.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch

from rlspmd.config import (
    ActorConfig,
    Config,
    CriticConfig,
    FSDPConfig,
    LoraConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RolloutConfig,
    TrainedRoleConfig,
    to_dict,
)
from rlspmd.distributed.dispatch import balance_batch, broadcast_object
from rlspmd.distributed.mesh import DP, RoleMeshes
from rlspmd.distributed.runtime import Runtime, StopRequest
from rlspmd.engines.base import TrainingEngine, compute_dtype
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.engines.lora import LoraEngine
from rlspmd.metrics import MetricBuffer
from rlspmd.models.loader import DTYPES, eos_token_ids, load_causal_lm, load_tokenizer
from rlspmd.models.lora import apply_lora, initial_adapters
from rlspmd.models.moe import is_moe
from rlspmd.models.packing import check_attn_kernel
from rlspmd.models.sharded_load import WeightPlan, meta_policy_module, meta_sequence_scorer, meta_value_model
from rlspmd.models.value import load_sequence_scorer, load_value_model
from rlspmd.protocol import Batch
from rlspmd.rewards import RewardManager
from rlspmd.rewards.shaping import NoShaping, OverlongShaping
from rlspmd.roles.base import CriticRole, ReferenceRole, UpdatePlan, update_plan
from rlspmd.roles.critic import Critic, NoCritic
from rlspmd.roles.policy import (
    NoPolicy,
    NoReference,
    OldLogProbs,
    Policy,
    Reference,
    build_policy_module,
    resolve_ref_offload,
)
from rlspmd.rewards.functions import spec_name
from rlspmd.roles.reward import NoReward, Reward, component_columns, component_manager
from rlspmd.roles.reward_model import RewardModel
from rlspmd.roles.moe import MoEActor, NoMoE
from rlspmd.agent import build_agent_loop
from rlspmd.agent import check_rows as check_agent_rows
from rlspmd.agent.loop import AgentLoop
from rlspmd.roles.rollout import Rollout, RolloutClient, RolloutRole, RolloutServer, SingleTurn
from rlspmd.rollout.native import NativeEngine, OwnWeights
from rlspmd.rollout.weight_sync import WeightBridge
from rlspmd.rollout.weights import BridgedWeights, InPlaceWeights, StreamedWeights
from rlspmd.trainer.advantage import AdvantageStage, build_token_rewards
from rlspmd.trainer.checkpoint import Checkpointer
from rlspmd.trainer.prompts import NoPrompts, Prompts
from rlspmd.trainer.rl import RLTrainer
from rlspmd.trainer.roles import Roles
from rlspmd.trainer.report import AgentMetrics, NoAgentMetrics, NoReport, StepReport
from rlspmd.roles.rollout_correction import (
    ResolvedRolloutCorrection,
    RolloutCorrectionStage,
    resolve_rollout_correction,
)
from rlspmd.trainer.samples import NoSampleLog, SampleLog
from rlspmd.trainer.sampling import DynamicSampling, FollowGreedy, FollowRounds, GreedyBaseline, NoBaseline, SingleRound
from rlspmd.trainer.state import Checkpointing, InFlightBatches, NoCheckpointing, write_model_files


@dataclass(frozen=True)
class RolePlan:
    """Which optional roles a run needs: the one rule, read from the config."""

    critic: bool
    reference: bool
    reward_model: bool
    greedy_baseline: bool

    @classmethod
    def of(cls, cfg: Config) -> "RolePlan":
        alg = cfg.algorithm
        return cls(
            critic=alg.adv_estimator.uses_critic,
            reference=cfg.actor.use_kl_loss or alg.use_kl_in_reward,
            reward_model=cfg.reward.model.path is not None,
            greedy_baseline=alg.adv_estimator.uses_greedy_baseline,
        )


class Skip:
    """A stage this rank does not run (the rollout-only ranks of a split placement hold no training data)."""

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch


class Balance:
    """Move samples between DP ranks so each trains on about the same number of tokens (``balance_batch``)."""

    def __init__(self, *, mesh, chunk_rows: int):
        self.mesh, self.chunk_rows = mesh, chunk_rows

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        batch, stats = balance_batch(batch, mesh=self.mesh, chunk_rows=self.chunk_rows)
        for k, v in stats.items():  # already global
            metrics.max(k, v)
        return batch


# -- roles on a training engine --------------------------------------------------------------------------------------


def role_plan(
    section: Literal["actor", "critic"],
    cfg: TrainedRoleConfig,
    *,
    samples_per_prompt: int,
    train_batch_size: int,
    dp: int,
    max_response_length: int,
    total_steps: int,
) -> UpdatePlan:
    """A trained role's update plan from its config section (the fields the actor and the critic share)."""
    return update_plan(
        section,
        ppo_epochs=cfg.ppo_epochs,
        mini_batch_size=cfg.mini_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        max_tokens=cfg.max_tokens_per_micro_batch,
        loss_agg_mode=cfg.loss_agg_mode,
        samples_per_prompt=samples_per_prompt,
        train_batch_size=train_batch_size,
        dp=dp,
        max_response_length=max_response_length,
        total_steps=total_steps,
    )


actor_plan = partial(role_plan, "actor")
critic_plan = partial(role_plan, "critic")


def build_engine(
    kind: Literal["policy", "value"],
    model_path: str,
    *,
    engine: FSDPConfig | MegatronConfig,
    model: ModelConfig,
    mesh,
    device: torch.device,
    optim: OptimConfig | None,
    total_optim_steps: int = 1,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    field_name: str,
    section: str,
    lora: LoraConfig | None = None,
    train_mesh=None,
    expert_mesh=None,
) -> TrainingEngine:
    """A role's model on its training engine: ``engine``, the engine component of the role's config ``section``.
    ``kind``: a causal LM returning log-probs (policy, reference) or a value model (critic); ``optim=None``: frozen.
    ``lora`` (rank > 0): a policy training LoRA adapters only (``LoraEngine``). ``train_mesh``: the ``(dp, tp)`` mesh of
    ``mesh.actor_tp`` > 1 (fsdp only, no LoRA: ``rlspmd.validate`` checked); ``expert_mesh``: the ``(edp, ep)`` mesh of
    ``mesh.actor_ep`` > 1 (the same conditions)."""
    assert train_mesh is None or (isinstance(engine, FSDPConfig) and not (lora is not None and lora.enabled)), (
        "validate: mesh.actor_tp"
    )
    if isinstance(engine, MegatronConfig):
        from rlspmd.engines.megatron import MegatronEngine, build_megatron_module

        if gradient_checkpointing:
            raise ValueError(
                f"{section}: gradient_checkpointing=True is not supported with {section}.engine:megatron yet"
            )
        module = build_megatron_module(
            kind,
            model_path,
            mesh=mesh,
            device=device,
            cfg=engine,
            dtype=model.dtype,
            seed=seed,
            field_name=field_name,
            field_prefix=f"{section}.engine",
        )
        return MegatronEngine(module, mesh=mesh, optim=optim, total_optim_steps=total_optim_steps)
    module, weights = fsdp_role_module(kind, model_path, model=model, seed=seed, field_name=field_name, lora=lora)
    kw = dict(
        mesh=mesh,
        device=device,
        fsdp=engine,
        optim=optim,
        total_optim_steps=total_optim_steps,
        gradient_checkpointing=gradient_checkpointing,
        weights=weights,
    )
    if train_mesh is not None:
        kw["train_mesh"] = train_mesh
    if expert_mesh is not None:
        kw["expert_mesh"] = expert_mesh
    if lora is not None and lora.enabled:
        return LoraEngine(module, module.hf, lora=lora, **kw)
    return FSDPEngine(module, module.hf, **kw)


def fsdp_role_module(
    kind: Literal["policy", "value", "scorer"],
    model_path: str,
    *,
    model: ModelConfig,
    seed: int = 0,
    field_name: str,
    lora: LoraConfig | None = None,
) -> tuple[torch.nn.Module, WeightPlan | None]:
    """A role module for the FSDP engine: built on the meta device with the plan of where its weights come from
    (``model.sharded_load``: the engine parallelises it, then each rank reads its slices), or loaded whole (None).
    ``lora``: a policy with LoRA adapters (initialised from ``seed``)."""
    kw = dict(
        dtype=model.dtype,
        attn_implementation=model.attn_implementation,
        field_name=field_name,
        packing=model.packing,
        attn_kernel=model.attn_kernel,
    )
    if model.sharded_load:
        if kind == "policy":
            return meta_policy_module(model_path, lora=lora, seed=seed, **kw)
        return (
            meta_value_model(model_path, seed=seed, **kw) if kind == "value" else meta_sequence_scorer(model_path, **kw)
        )
    if kind == "policy":
        module = build_policy_module(model_path, **kw)
        if lora is not None and lora.enabled:
            apply_lora(module.hf, lora)
            with torch.no_grad():
                params = dict(module.named_parameters())
                for name, value in initial_adapters(module, seed=seed).items():
                    params[name].copy_(value)
        return module, None
    return (
        load_value_model(model_path, seed=seed, **kw) if kind == "value" else load_sequence_scorer(model_path, **kw)
    ), None


def actor_compute_dtype(cfg: ActorConfig, device: torch.device) -> torch.dtype:
    """The dtype of the actor's forwards (its engine's ``param_dtype``; ``auto``: bfloat16 on CUDA, float32 on CPU)."""
    return compute_dtype(cfg.engine.param_dtype, device)


def build_policy(
    cfg: ActorConfig,
    *,
    mesh,
    device: torch.device,
    plan: UpdatePlan,
    temperature: float,
    correction: ResolvedRolloutCorrection | None = None,
    old_logprobs: OldLogProbs = "recompute",
    seed: int = 0,
    train_mesh=None,
    expert_mesh=None,
    rollout_routing: bool = False,
) -> Policy:
    """``rollout_routing``: the rollout engine records the experts of a MoE model's tokens (``roles/moe.py``)."""
    engine = build_engine(
        "policy",
        cfg.model.path,
        engine=cfg.engine,
        model=cfg.model,
        mesh=mesh,
        device=device,
        optim=cfg.optim,
        total_optim_steps=plan.optim_steps,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        seed=seed,
        field_name="actor.model.path",
        section="actor",
        lora=cfg.lora,
        train_mesh=train_mesh,
        expert_mesh=expert_mesh,
    )
    hf_config = engine.hf_model.config
    moe = (
        MoEActor(
            cfg.moe,
            model_aux_loss_coef=hf_config.router_aux_loss_coef,
            num_experts=hf_config.num_experts,
            rollout_routing=rollout_routing,
            metrics_in_update=old_logprobs != "recompute",
            mesh=mesh,
        )
        if is_moe(hf_config)
        else NoMoE()
    )
    return Policy(
        cfg,
        engine=engine,
        plan=plan,
        temperature=temperature,
        correction=correction,
        old_logprobs=old_logprobs,
        seed=seed,
        moe=moe,
    )


def build_reference(
    cfg: RefConfig,
    *,
    actor: ActorConfig,
    mesh,
    device: torch.device,
    temperature: float,
    policy: Policy | None = None,
    train_mesh=None,
    expert_mesh=None,
) -> Reference:
    """The reference runs on the actor's engine and layout. With LoRA it is the actor's own engine with the adapters
    switched off (the base model: no second copy of the weights)."""
    if actor.lora.enabled:
        assert policy is not None, "a LoRA reference is the actor's engine with the adapters off"
        if cfg.offload:
            warnings.warn(
                "ref.offload does nothing with actor.lora: the reference reads the actor's weights", stacklevel=2
            )
        assert isinstance(policy.engine, LoraEngine), "build_policy gives a LoRA policy a LoraEngine"
        return Reference(cfg, engine=policy.engine.base_model(), temperature=temperature, offload=False)
    engine = build_engine(
        "policy",
        cfg.model_path or actor.model.path,
        engine=actor.engine,
        model=actor.model,
        mesh=mesh,
        device=device,
        optim=None,
        field_name="ref.model_path",
        section="actor",
        train_mesh=train_mesh,
        expert_mesh=expert_mesh,
    )
    offload = resolve_ref_offload(
        cfg, device=device, cpu_offload=isinstance(actor.engine, FSDPConfig) and actor.engine.cpu_offload
    )
    return Reference(cfg, engine=engine, temperature=temperature, offload=offload)


def build_critic(
    cfg: CriticConfig, *, model: ModelConfig, mesh, device: torch.device, plan: UpdatePlan, seed: int, train_mesh=None
) -> Critic:
    """``model``: the actor's model section (the critic starts from its weights unless ``critic.model_path`` is set)."""
    engine = build_engine(
        "value",
        cfg.model_path or model.path,
        engine=cfg.engine,
        model=model,
        mesh=mesh,
        device=device,
        optim=cfg.optim,
        total_optim_steps=plan.optim_steps,
        gradient_checkpointing=cfg.gradient_checkpointing,
        seed=seed,
        field_name="critic.model_path" if cfg.model_path else "actor.model.path",
        section="critic",
        train_mesh=train_mesh,
    )
    return Critic(cfg, engine=engine, plan=plan)


def build_reward_model(cfg: Config, *, tokenizer, mesh, device: torch.device) -> RewardModel:
    rm, m = cfg.reward.model, cfg.actor.model
    module, weights = fsdp_role_module("scorer", rm.path, model=m, field_name="reward.model.path")
    rm_tokenizer = load_tokenizer(
        rm.tokenizer_path or rm.path, field_name="reward.model.tokenizer_path", require_chat_template=False
    )
    # always FSDP: with a megatron actor, on FSDP's defaults
    fsdp = cfg.actor.engine if isinstance(cfg.actor.engine, FSDPConfig) else FSDPConfig()
    engine = FSDPEngine(module, module.hf, mesh=mesh, device=device, fsdp=fsdp, optim=None, weights=weights)
    return RewardModel(rm, engine=engine, tokenizer=rm_tokenizer, actor_tokenizer=tokenizer, device=device)


# -- the rollout -----------------------------------------------------------------------------------------------------


def rollout_dtype(cfg: RolloutConfig, *, compute: torch.dtype) -> torch.dtype:
    return compute if cfg.dtype == "auto" else DTYPES[cfg.dtype]


def build_rollout_engine(
    cfg: RolloutConfig,
    *,
    weights,
    model_path: str,
    dtype: torch.dtype,
    sleeps: bool,
    tp: int,
    seed: int,
    eos_ids: list[int],
    pad_id: int,
    device: torch.device,
    max_model_len: int,
):
    """The generation engine of one rank: native (reading ``weights`` in place when they are ``InPlaceWeights``, else a
    private copy loaded from disk and replaced at the first sync) or vLLM (in-process, dummy weights until the first sync)."""
    if cfg.engine == "native":
        if not weights.in_place:
            weights = OwnWeights(
                load_causal_lm(
                    model_path, dtype=dtype_name(dtype), attn_implementation="sdpa", field_name="actor.model.path"
                ).to(device)
            )
        return NativeEngine(
            weights,
            eos_ids=eos_ids,
            pad_id=pad_id,
            max_batch_size=cfg.max_batch_size,
            device=device,
            compile_decode=cfg.compile_decode,
            cuda_graphs=cfg.cuda_graphs,
        )
    from rlspmd.rollout.vllm import VllmEngine
    from third_party.vllm_adapter import VllmBackend

    v = cfg.vllm
    backend = VllmBackend(
        model_path,
        tensor_parallel_size=tp,
        seed=seed,
        dtype=dtype,
        max_model_len=v.max_model_len or max_model_len,
        gpu_memory_utilization=v.gpu_memory_utilization,
        kv_cache_memory_bytes=v.kv_cache_memory_bytes,
        max_num_seqs=v.max_num_seqs,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=v.enable_prefix_caching,
        sleeps=sleeps,
    )
    return VllmEngine(backend, sleeps=sleeps, sleep_level=v.sleep_level, eos_ids=eos_ids, pad_id=pad_id, device=device)


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
    lend its gathered weights (FSDP2; a megatron actor streams them). ``episodes``: single- or multi-turn samples
    (``build_episodes``); they run where generation runs (in split placement, tools run on the rollout ranks).
    ``max_staleness`` (split only): how many steps ahead the rollout ranks generate; ``draw``: the actor ranks' next
    prompts, which fill that pipeline. Collective: weight-stream manifests are local, but a vLLM engine's construction
    spans the whole world."""
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
        in_place = cfg.engine == "native" and dtype == compute and in_place_capable
        weights = InPlaceWeights(policy.engine) if in_place else StreamedWeights(policy.engine.weight_stream(dtype))
        engine = build_rollout_engine(cfg, weights=weights, sleeps=True, seed=seed + meshes.dp_rank("rollout"), **kw)
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
    engine = build_rollout_engine(cfg, weights=weights, sleeps=False, seed=seed + meshes.dp_rank("rollout"), **kw)
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


# -- the whole rank --------------------------------------------------------------------------------------------------


def build_roles(cfg: Config, rt: Runtime, meshes: RoleMeshes) -> Roles:
    """What this rank runs, for a config ``rlspmd.validate.check_config`` has passed (sizes, placement, files).
    Collective over the world (every rank calls it once, in the same order)."""
    trainer = cfg.trainer
    plan = RolePlan.of(cfg)
    m = cfg.actor.model
    # The attention kernel is checked before any model loads (a kernel this device cannot run fails in seconds).
    attn_kernel = check_attn_kernel(
        m.attn_kernel,
        attn_implementation=m.attn_implementation,
        packing=m.packing,
        device=rt.device,
        dtype=actor_compute_dtype(cfg.actor, rt.device),
        field_name="actor.model.attn_kernel",
    )
    correction = build_rollout_correction(
        cfg, compute=actor_compute_dtype(cfg.actor, rt.device), split=meshes.dims.disjoint("actor", "rollout")
    )
    tokenizer = load_tokenizer(
        m.tokenizer_path or m.path, field_name="actor.model.tokenizer_path" if m.tokenizer_path else "actor.model.path"
    )
    eos_ids, pad_id = eos_token_ids(m.path, tokenizer), tokenizer.pad_token_id
    episodes = build_episodes(
        cfg.rollout,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        pad_id=pad_id,
        model_field="actor.model.tokenizer_path" if m.tokenizer_path else "actor.model.path",
    )
    rollout_kw = dict(
        meshes=meshes,
        model_path=m.path,
        compute=actor_compute_dtype(cfg.actor, rt.device),
        eos_ids=eos_ids,
        pad_id=pad_id,
        device=rt.device,
        seed=trainer.seed,
        max_prompt_length=cfg.data.max_prompt_length,
        in_place_capable=isinstance(cfg.actor.engine, FSDPConfig) and cfg.mesh.actor_tp == 1 and cfg.mesh.actor_ep == 1,
        episodes=episodes,
        max_staleness=trainer.max_staleness,
    )
    if not meshes.hosts("actor"):
        return _rollout_only_roles(
            cfg,
            rt,
            rollout=build_rollout(cfg.rollout, policy=None, **rollout_kw),
            plan=plan,
            attn_kernel=attn_kernel,
            correction=correction,
        )

    mesh = meshes.get("actor", DP)
    train_mesh = meshes.train_mesh("actor")  # (dp, tp) with mesh.actor_tp > 1: the engines' layout, not the data's
    dp, n, R = mesh.size(), cfg.rollout.n, cfg.rollout.max_response_length
    tbs = cfg.data.train_batch_size
    checkpointer = Checkpointer(cfg.checkpoint, output_dir=trainer.output_dir, rank=rt.rank, world_size=dp, mesh=mesh)
    resume_from = checkpointer.prepare()
    sampling = (
        DynamicSampling(
            cfg.algorithm.filter_groups, mesh=mesh, train_batch_size=tbs, samples_per_prompt=n, pad_id=pad_id
        )
        if cfg.algorithm.filter_groups.enable
        else SingleRound(train_batch_size=tbs)
    )
    prompts = Prompts(
        cfg.data,
        tokenizer,
        mesh=mesh,
        device=rt.device,
        is_main=rt.is_main,
        prompts_per_round=sampling.prompts_per_round,
        seed=trainer.seed,
        tools=episodes.tool_schemas,
    )
    if (
        prompts.train is not None
    ):  # rank 0 read the files: their agent columns must fit the run (verl's agent_name, ...)
        for field_name, ds in (("data.train_files", prompts.train), ("data.val_files", prompts.val)):
            check_agent_rows(ds.rows, loop=episodes if cfg.rollout.agent.enabled else None, field_name=field_name)
    data_stats = broadcast_object(prompts.stats())  # over the world: rollout-only ranks follow the validation rounds

    plans = dict(samples_per_prompt=n, train_batch_size=tbs, dp=dp, max_response_length=R)
    critic: CriticRole = NoCritic()
    critic_rows = 0
    if plan.critic:
        c_plan = critic_plan(cfg.critic, total_steps=trainer.total_steps, **plans)
        critic = build_critic(
            cfg.critic, model=m, mesh=mesh, device=rt.device, plan=c_plan, seed=trainer.seed, train_mesh=train_mesh
        )
        critic_rows = c_plan.local_mini_batch
    a = cfg.actor
    a_plan = actor_plan(a, total_steps=max(1, trainer.total_steps - critic.warmup_steps), **plans)
    old_logprobs = old_logprob_source(
        a, single_update=a_plan.single_update, correction=correction, use_kl_in_reward=cfg.algorithm.use_kl_in_reward
    )
    expert_mesh = meshes.expert_mesh("actor")
    actor = build_policy(
        a,
        mesh=mesh,
        device=rt.device,
        plan=a_plan,
        temperature=cfg.rollout.temperature,
        correction=correction,
        old_logprobs=old_logprobs,
        seed=trainer.seed,
        train_mesh=train_mesh,
        expert_mesh=expert_mesh,
        rollout_routing=records_routing(cfg.rollout),
    )
    ref: ReferenceRole = (
        build_reference(
            cfg.ref,
            actor=a,
            mesh=mesh,
            device=rt.device,
            temperature=cfg.rollout.temperature,
            policy=actor,
            train_mesh=train_mesh,
            expert_mesh=expert_mesh,
        )
        if plan.reference
        else NoReference()
    )
    rollout = build_rollout(cfg.rollout, policy=actor, draw=prompts.next, **rollout_kw)
    reward_model = (
        build_reward_model(cfg, tokenizer=tokenizer, mesh=mesh, device=rt.device) if plan.reward_model else None
    )
    extra = {spec_name(spec): component_manager(cfg.reward, spec, tokenizer) for spec in cfg.reward.components}
    reward = Reward(
        cfg.reward,
        rules=RewardManager(cfg.reward, tokenizer),
        model=reward_model,
        agent=cfg.rollout.agent.enabled,
        extra=extra,
    )
    shaping = (
        OverlongShaping(cfg.reward.overlong_buffer, max_response_length=R)
        if cfg.reward.overlong_buffer.enable
        else NoShaping()
    )
    baseline = (
        GreedyBaseline(rollout=rollout, score=lambda b, m: shaping(reward.score(b, m), m), samples_per_prompt=n)
        if plan.greedy_baseline
        else NoBaseline()
    )
    token_rewards = build_token_rewards(cfg.algorithm, mesh=mesh)
    # Balance within chunks that lie inside one mini-batch of the actor AND of the critic: both see the same samples.
    balance = (
        Balance(mesh=mesh, chunk_rows=math.gcd(a_plan.local_mini_batch, critic_rows))
        if trainer.balance_batch
        else Skip()
    )
    components = {"sampler": prompts.sampler} if prompts.sampler is not None else {}
    if cfg.algorithm.use_kl_in_reward:
        components["token_rewards"] = token_rewards  # the adaptive KL controller's coefficient
    engines = {"actor": actor.engine, **({"critic": critic.engine} if plan.critic else {})}
    # Asynchronous RL: the batches generated ahead are saved, so a resume trains on exactly what the run would have.
    pipeline = (
        InFlightBatches(rollout.queue, rank=mesh.get_local_rank(), device=rt.device) if trainer.max_staleness else None
    )
    checkpointing = Checkpointing(
        checkpointer,
        engines=engines,
        components=components,
        pipeline=pipeline,
        mesh=mesh,
        rank=rt.rank,
        is_main=rt.is_main,
        meta={"total_steps": trainer.total_steps, "models": {"actor": m.path}, "config": to_dict(cfg)},
        write_files=partial(
            write_model_files,
            model_path=m.path,
            tokenizer_path=m.tokenizer_path,
            save_hf=cfg.checkpoint.save_hf,
            tokenizer=tokenizer,
            engine=actor.engine,
            mesh=mesh,
        ),
    )
    shaping_parts = (("overlong_penalty_B", "overlong_penalty"),) if cfg.reward.overlong_buffer.enable else ()
    samples = (
        SampleLog(
            trainer.samples,
            tokenizer=tokenizer,
            mesh=mesh,
            output_dir=trainer.output_dir,
            eos_ids=eos_ids,
            max_response_length=R,
            reward_columns=component_columns(cfg.reward, agent=cfg.rollout.agent.enabled),
            tool_names=episodes.tool_names if cfg.rollout.agent.enabled else None,
            val_prompts=data_stats["val_prompts"],
        )
        if trainer.samples.enable
        else NoSampleLog()
    )
    return Roles(
        prompts=prompts,
        rollout=rollout,
        reward=reward,
        shaping=shaping,
        baseline=baseline,
        sampling=sampling,
        ref=ref,
        actor=actor,
        critic=critic,
        token_rewards=token_rewards,
        advantage=AdvantageStage(cfg.algorithm.adv_estimator, mesh=mesh),
        correction=RolloutCorrectionStage(correction) if old_logprobs == "recompute" else Skip(),
        balance=balance,
        report=StepReport(
            mesh=mesh,
            eos_ids=eos_ids,
            max_response_length=R,
            components=reward.components + shaping_parts,
            agent=AgentMetrics(tool_names=episodes.tool_names, mesh=mesh)
            if cfg.rollout.agent.enabled
            else NoAgentMetrics(),
        ),
        samples=samples,
        checkpointing=checkpointing,
        data_stats=data_stats,
        resume_from=resume_from,
        attn_kernel=attn_kernel,
        rollout_correction=correction,
    )


def build_rollout_correction(cfg: Config, *, compute: torch.dtype, split: bool) -> ResolvedRolloutCorrection:
    """``algorithm.rollout_correction`` resolved from the facts of this run (engine, rollout and actor dtypes, placement,
    staleness). Bypass mode's conditions on the resolution are checked by ``rlspmd.validate`` (which resolves it the
    same way) before anything loads."""
    return resolve_rollout_correction(
        cfg.algorithm.rollout_correction,
        engine=cfg.rollout.engine,
        rollout_dtype=cfg.rollout.dtype,
        actor_compute_dtype=dtype_name(compute),
        placement="split" if split else "colocated",
        max_staleness=cfg.trainer.max_staleness,
    )


def old_logprob_source(
    cfg: ActorConfig, *, single_update: bool, correction: ResolvedRolloutCorrection, use_kl_in_reward: bool
) -> OldLogProbs:
    """Bypass mode: the rollout's log-probs. One update per step and no consumer of old log-probs before it (KL in the
    reward reads them; MoE router replay R2 replays its routing): the update's own forward. Otherwise a forward of
    their own."""
    if correction.bypass:
        return "rollout"
    # R2 replays the routing of the old-log-prob pass: it needs that pass
    if cfg.reuse_update_logprobs and single_update and not use_kl_in_reward and cfg.moe.router_replay != "R2":
        return "update"
    return "recompute"


def records_routing(cfg: RolloutConfig) -> bool:
    """The rollout engine records a MoE model's routing with every sample (``rollout_routing_BL``): the native
    engine's single-turn generation does; vLLM's and the agent loop's do not (``rlspmd.validate`` refuses R3 there)."""
    return cfg.engine == "native" and not cfg.agent.enabled


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _rollout_only_roles(
    cfg: Config,
    rt: Runtime,
    *,
    rollout: RolloutServer,
    plan: RolePlan,
    attn_kernel: str,
    correction: ResolvedRolloutCorrection,
) -> Roles:
    """Split placement, a rank that hosts only the rollout: it serves generation and the weight sync, in step with the
    actor's ranks; nothing else happens here."""
    data_stats = broadcast_object(None)
    sampling = (
        FollowRounds(cfg.algorithm.filter_groups)
        if cfg.algorithm.filter_groups.enable
        else SingleRound(train_batch_size=0)
    )
    return Roles(
        prompts=NoPrompts(),
        rollout=rollout,
        reward=NoReward(),
        shaping=NoShaping(),
        baseline=FollowGreedy(rollout=rollout) if plan.greedy_baseline else NoBaseline(),
        sampling=sampling,
        ref=NoReference(),
        actor=NoPolicy(),
        critic=NoCritic(),
        token_rewards=Skip(),
        advantage=Skip(),
        correction=Skip(),
        balance=Skip(),
        report=NoReport(),
        samples=NoSampleLog(),
        checkpointing=NoCheckpointing(),
        data_stats=data_stats,
        resume_from=None,
        attn_kernel=attn_kernel,
        rollout_correction=correction,
    )


def build_trainer(cfg: Config, rt: Runtime, meshes: RoleMeshes):
    """The trainer every rank runs (the rollout-only ranks of a split placement too, with their own roles)."""
    stop_request = StopRequest().install()
    roles = build_roles(cfg, rt, meshes)
    return RLTrainer(
        cfg.trainer,
        roles=roles,
        rt=rt,
        stop_request=stop_request,
        val_batch_size=cfg.data.val_batch_size,
        messages=[
            f"packed attention kernel: {roles.attn_kernel}",
            f"rollout correction: {roles.rollout_correction.summary()}",
            *_warnings(cfg),
        ],
    )


def _warnings(cfg: Config) -> list[str]:
    from rlspmd.config import ignored_settings

    return [f"warning: {message}; ignored" for message in ignored_settings(cfg)]
