"""The builder's roles on a training engine: the actor (``Policy``), the reference, the teacher, the critic and the
reward model, each a model built by its role's engine component (``actor.engine.build(...)``,
``critic.engine.build(...)``), and the update plans of the trained roles."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Literal

import torch

from rlspmd.algorithms.distill import TeacherConfig
from rlspmd.config import ActorConfig, Config, CriticConfig, ModelConfig, RefConfig, RolloutConfig, TrainedRoleConfig
from rlspmd.engines.fsdp import LoraEngine
from rlspmd.models.loader import load_tokenizer
from rlspmd.roles.base import UpdatePlan, update_plan
from rlspmd.models.moe import is_moe
from rlspmd.roles.critic import Critic
from rlspmd.roles.moe import MoEActor, NoMoE
from rlspmd.roles.policy import LossTerm, OldLogProbs, Policy, Reference, resolve_ref_offload
from rlspmd.roles.reward_model import RewardModel
from rlspmd.roles.rollout_correction import ResolvedRolloutCorrection
from rlspmd.roles.teacher import Teacher, resolve_teacher_offload


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
    sequence_mesh=None,
    sequence_mode: str = "auto",
    rollout_routing: bool = False,
    sum_pi_squared: bool = False,
    loss_term: LossTerm | None = None,
) -> Policy:
    """``rollout_routing``: the rollout engine records the experts of a MoE model's tokens (``roles/moe.py``).
    ``sequence_mesh``, ``sequence_mode``: ``mesh.actor_sp`` > 1 (``RoleMeshes.sequence_mesh``,
    ``mesh.actor_sp_mode``)."""
    engine = cfg.engine.build(
        "policy",
        cfg.model.path,
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
        sequence_mesh=sequence_mesh,
        sequence_mode=sequence_mode,
        freeze_vision=cfg.freeze_vision_tower,
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
        sum_pi_squared=sum_pi_squared,
        loss_term=loss_term,
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
    sequence_mesh=None,
    sequence_mode: str = "auto",
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
    engine = actor.engine.build(
        "policy",
        cfg.model_path or actor.model.path,
        model=actor.model,
        mesh=mesh,
        device=device,
        optim=None,
        field_name="ref.model_path",
        section="actor",
        train_mesh=train_mesh,
        expert_mesh=expert_mesh,
        sequence_mesh=sequence_mesh,
        sequence_mode=sequence_mode,
    )
    offload = resolve_ref_offload(cfg, device=device, cpu_offload=actor.engine.params_on_host())
    return Reference(cfg, engine=engine, temperature=temperature, offload=offload)


def build_teacher(
    cfg: TeacherConfig, *, actor: ActorConfig, mesh, device: torch.device, temperature: float, train_mesh=None
) -> Teacher:
    """The teacher, loaded like the reference (sharded, on the meta device, by the actor's engine and on its layout),
    frozen, from ``teacher.model_path``; the actor's ``model`` section sets how (dtype, attention, packing)."""
    engine = actor.engine.build(
        "policy",
        cfg.model_path,
        model=actor.model,
        mesh=mesh,
        device=device,
        optim=None,
        field_name="teacher.model_path",
        section="actor",
        train_mesh=train_mesh,
    )
    offload = resolve_teacher_offload(cfg, device=device, cpu_offload=actor.engine.params_on_host())
    return Teacher(cfg, engine=engine, temperature=temperature, offload=offload, argmax=actor.engine.vocab_outputs)


def build_critic(
    cfg: CriticConfig,
    *,
    model: ModelConfig,
    mesh,
    device: torch.device,
    plan: UpdatePlan,
    seed: int,
    train_mesh=None,
    sequence_mesh=None,
    sequence_mode: str = "auto",
) -> Critic:
    """``model``: the actor's model section (the critic starts from its weights unless ``critic.model_path`` is set)."""
    engine = cfg.engine.build(
        "value",
        cfg.model_path or model.path,
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
        sequence_mesh=sequence_mesh,
        sequence_mode=sequence_mode,
    )
    return Critic(cfg, engine=engine, plan=plan)


def build_reward_model(cfg: Config, *, tokenizer, mesh, device: torch.device) -> RewardModel:
    """A frozen sequence scorer on the actor's engine (an engine without scorers, megatron, hands it to FSDP)."""
    rm, m = cfg.reward.model, cfg.actor.model
    engine = cfg.actor.engine.build(
        "scorer",
        rm.path,
        model=m,
        mesh=mesh,
        device=device,
        optim=None,
        field_name="reward.model.path",
        section="actor",
    )
    rm_tokenizer = load_tokenizer(
        rm.tokenizer_path or rm.path, field_name="reward.model.tokenizer_path", require_chat_template=False
    )
    return RewardModel(rm, engine=engine, tokenizer=rm_tokenizer, actor_tokenizer=tokenizer, device=device)


def old_logprob_source(
    cfg: ActorConfig,
    *,
    single_update: bool,
    correction: ResolvedRolloutCorrection,
    use_kl_in_reward: bool,
    read_before_update: bool = False,
) -> OldLogProbs:
    """Bypass mode: the rollout's log-probs. One update per step and no consumer of old log-probs before it (KL in the
    reward reads them; ``read_before_update``: the estimator, or a teacher's signal on the advantage; MoE router replay
    R2 replays its routing): the update's own forward. Otherwise a forward of their own."""
    if correction.bypass:
        return "rollout"
    # R2 replays the routing of the old-log-prob pass: it needs that pass
    if (
        cfg.reuse_update_logprobs
        and single_update
        and not use_kl_in_reward
        and not read_before_update
        and cfg.moe.router_replay != "R2"
    ):
        return "update"
    return "recompute"


def records_routing(cfg: RolloutConfig) -> bool:
    """The rollout engine records a MoE model's routing with every sample (``rollout_routing_BL``): an engine with
    ``records_routing`` (the native engine's single-turn generation); not the agent loop's (``rlspmd.validate``
    refuses R3 where the routing is not recorded)."""
    return cfg.engine.records_routing and not cfg.agent.enabled
