"""The builder: the one place that turns a ``Config`` into what each rank runs.

* **Which roles exist** follows from one rule, ``RolePlan.of(config)``: a critic for estimators that read values, a
  reference when a KL term needs it, a teacher when ``teacher.model_path`` names one, a reward model when one is
  configured, a greedy baseline for ReMax.
* **Where they run**: the reference, critic and reward model live on the actor's ranks; the rollout shares them
  (colocated) or has ranks of its own (split). The config (placement, sizes, files) was checked before this runs
  (``rlspmd/validate/``, on every rank, before anything loads).
* **What a rank holds** (``Roles``): on the actor's ranks the real roles; on the rollout-only ranks of a split
  placement, objects that do nothing except serve the rollout (``RolloutServer``), so every rank runs the same step.
* Models are built and parallelised by the role's engine component (``actor.engine.build(...)``:
  ``engines/fsdp``, ``engines/megatron``), then handed to the role that uses them (``build_models.py``); the
  rollout engine is built by ``rollout.engine.build(...)`` (``build_rollout.py``). The tokenizer is loaded once.
* **What a checkpoint holds** is named here (``Checkpointing``): the trained engines and the trainer components.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from rlspmd.agent import check_rows as check_agent_rows
from rlspmd.config import Config, to_dict
from rlspmd.data.images import MultimodalPrompts
from rlspmd.distributed.dispatch import balance_batch, broadcast_object
from rlspmd.distributed.mesh import DP, RoleMeshes
from rlspmd.distributed.runtime import Runtime, StopRequest
from rlspmd.engines.base import precision_summary
from rlspmd.metrics import MetricBuffer
from rlspmd.models.loader import eos_token_ids, load_tokenizer
from rlspmd.models.attn_kernels import check_attn_kernel
from rlspmd.protocol import Batch
from rlspmd.rewards import RewardManager
from rlspmd.rewards.functions import spec_name
from rlspmd.rewards.shaping import NoShaping, OverlongShaping
from rlspmd.roles.base import CriticRole, ReferenceRole
from rlspmd.roles.critic import NoCritic
from rlspmd.roles.policy import NoPolicy, NoReference
from rlspmd.roles.reward import NoReward, Reward, component_columns, component_manager
from rlspmd.roles.rollout import RolloutServer
from rlspmd.roles.rollout_correction import ResolvedRolloutCorrection, RolloutCorrectionStage
from rlspmd.roles.teacher import NoTeacher, TeacherAdvantage, TeacherLossTerm
from rlspmd.stages import StagePoints
from rlspmd.trainer.advantage import AdvantageStage, build_token_rewards
from rlspmd.trainer.build_models import (
    actor_plan,
    build_critic,
    build_policy,
    build_reference,
    build_reward_model,
    build_teacher,
    critic_plan,
    old_logprob_source,
    records_routing,
)
from rlspmd.trainer.build_rollout import build_episodes, build_rollout, build_rollout_correction, rollout_dtype
from rlspmd.trainer.checkpoint import Checkpointer, read_meta
from rlspmd.trainer.prompts import NoPrompts, Prompts
from rlspmd.trainer.report import AgentMetrics, NoAgentMetrics, NoReport, StepReport
from rlspmd.trainer.rl import RLTrainer
from rlspmd.trainer.roles import Roles
from rlspmd.trainer.samples import NoSampleLog, SampleLog
from rlspmd.trainer.sampling import DynamicSampling, FollowGreedy, FollowRounds, GreedyBaseline, NoBaseline, SingleRound
from rlspmd.trainer.checkpoint import Checkpointing, InFlightBatches, NoCheckpointing, write_model_files
from rlspmd.trackers import Trackers


@dataclass(frozen=True)
class RolePlan:
    """Which optional roles a run needs: the one rule, read from the config."""

    critic: bool
    reference: bool
    teacher: bool
    reward_model: bool
    greedy_baseline: bool

    @classmethod
    def of(cls, cfg: Config) -> "RolePlan":
        alg = cfg.algorithm
        return cls(
            critic=alg.adv_estimator.uses_critic,
            reference=cfg.actor.use_kl_loss or alg.use_kl_in_reward,
            teacher=cfg.teacher.enabled,
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
        dtype=cfg.actor.engine.compute_dtype(rt.device),
        field_name="actor.model.attn_kernel",
    )
    correction = build_rollout_correction(
        cfg, compute=cfg.actor.engine.compute_dtype(rt.device), split=meshes.dims.disjoint("actor", "rollout")
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
        compute=cfg.actor.engine.compute_dtype(rt.device),
        eos_ids=eos_ids,
        pad_id=pad_id,
        device=rt.device,
        seed=trainer.seed,
        max_prompt_length=cfg.data.max_prompt_length,
        in_place_capable=cfg.actor.engine.lends_weights and cfg.mesh.actor_tp == 1 and cfg.mesh.actor_ep == 1,
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
    # mesh.actor_sp > 1: this rank's sequence-parallel group (the engines split packed sequences; data stays per rank)
    seq = dict(sequence_mesh=meshes.sequence_mesh("actor"), sequence_mode=cfg.mesh.actor_sp_mode)
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
    # a vision-language model's image processing, where the prompts are read and the samples written
    vision = MultimodalPrompts.for_model(m.path, tokenizer, field_name="actor.model.path") if rt.is_main else None
    prompts = Prompts(
        cfg.data,
        tokenizer,
        mesh=mesh,
        device=rt.device,
        is_main=rt.is_main,
        prompts_per_round=sampling.prompts_per_round,
        seed=trainer.seed,
        tools=episodes.tool_schemas,
        vision=vision,
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
            cfg.critic,
            model=m,
            mesh=mesh,
            device=rt.device,
            plan=c_plan,
            seed=trainer.seed,
            train_mesh=train_mesh,
            **seq,
        )
        critic_rows = c_plan.local_mini_batch
    a, estimator, signal = cfg.actor, cfg.algorithm.adv_estimator, cfg.teacher.signal
    a_plan = actor_plan(a, total_steps=max(1, trainer.total_steps - critic.warmup_steps), **plans)
    old_logprobs = old_logprob_source(
        a,
        single_update=a_plan.single_update,
        correction=correction,
        use_kl_in_reward=cfg.algorithm.use_kl_in_reward,
        read_before_update=estimator.uses_old_logprobs or (plan.teacher and signal.at == "advantage"),
    )
    teacher = (
        build_teacher(
            cfg.teacher,
            actor=a,
            mesh=mesh,
            device=rt.device,
            temperature=cfg.rollout.temperature,
            train_mesh=train_mesh,
        )
        if plan.teacher
        else NoTeacher()
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
        **seq,
        rollout_routing=records_routing(cfg.rollout),
        sum_pi_squared=estimator.uses_sum_pi_squared,
        loss_term=TeacherLossTerm(signal.build(), teacher=teacher) if plan.teacher and signal.at == "loss" else None,
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
            **seq,
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
    trackers = Trackers(trainer.loggers, trainer.tracking, output_dir=trainer.output_dir, config=to_dict(cfg))
    saved = read_meta(resume_from).get("trainer_components", []) if resume_from is not None else None
    components.update(trackers.component(is_main=rt.is_main, saved=saved))  # their run ids: a resume continues them
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
        meta={
            "total_steps": trainer.total_steps,
            "models": {"actor": m.path, **({"teacher": cfg.teacher.model_path} if plan.teacher else {})},
            "config": to_dict(cfg),
        },
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
            vision=vision,
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
        teacher=teacher,
        actor=actor,
        critic=critic,
        token_rewards=token_rewards,
        advantage=AdvantageStage(cfg.algorithm.adv_estimator, mesh=mesh),
        distill=TeacherAdvantage(signal.build()) if plan.teacher and signal.at == "advantage" else Skip(),
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
        trackers=trackers,
        checkpointing=checkpointing,
        data_stats=data_stats,
        resume_from=resume_from,
        attn_kernel=attn_kernel,
        rollout_correction=correction,
        stages=user_stages(trainer.stages, mesh=mesh, tokenizer=tokenizer),
    )


def user_stages(stages, *, mesh, tokenizer) -> StagePoints:
    """``trainer.stages`` built, grouped by their point of the step, in the config's order."""
    points: dict = {}
    for stage in stages:
        points.setdefault(stage.at, []).append(stage.build(mesh=mesh, tokenizer=tokenizer))
    return StagePoints(points)


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
        teacher=NoTeacher(),
        actor=NoPolicy(),
        critic=NoCritic(),
        token_rewards=Skip(),
        advantage=Skip(),
        distill=Skip(),
        correction=Skip(),
        balance=Skip(),
        report=NoReport(),
        samples=NoSampleLog(),
        trackers=Trackers(),
        checkpointing=NoCheckpointing(),
        data_stats=data_stats,
        resume_from=None,
        attn_kernel=attn_kernel,
        rollout_correction=correction,
        stages=StagePoints(),
    )


def build_trainer(cfg: Config, rt: Runtime, meshes: RoleMeshes, *, warnings: Sequence[str] = ()):
    """The trainer every rank runs (the rollout-only ranks of a split placement too, with their own roles).
    ``warnings``: settings the config check found to do nothing (``rlspmd.validate.ignored_settings``), for the log."""
    stop_request = StopRequest().install()
    roles = build_roles(cfg, rt, meshes)
    return RLTrainer(
        cfg.trainer,
        roles=roles,
        rt=rt,
        stop_request=stop_request,
        val_batch_size=cfg.data.val_batch_size,
        messages=[
            precision_summary(
                cfg.actor.engine,
                rt.device,
                master=cfg.actor.model.dtype,
                rollout=rollout_dtype(cfg.rollout, compute=cfg.actor.engine.compute_dtype(rt.device)),
            ),
            f"packed attention kernel: {roles.attn_kernel}",
            f"rollout correction: {roles.rollout_correction.summary()}",
            *(f"warning: {message}; ignored" for message in warnings),
        ],
    )
