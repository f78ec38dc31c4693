"""The checks of each config section, each given the sections it reads (one place per check). Components check their
own options (``problems()``); ``component_problems`` names them by where they sit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rlspmd.config import (
    GDPO,
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    CriticConfig,
    DataConfig,
    DistConfig,
    LoraConfig,
    MeshConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainedRoleConfig,
)
from rlspmd.rollout.base import RolloutEngineConfig
from rlspmd.validate.problems import Problems

from rlspmd.metrics import SINKS as LOGGERS
from rlspmd.trackers import TrackerConfig, missing_packages


def check_data(p: Problems, d: DataConfig) -> None:
    for name, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if not files:
            p.add(name, files, "give at least one parquet or jsonl file")
    p.at_least("data.max_prompt_length", d.max_prompt_length, 1)
    p.at_least("data.train_batch_size", d.train_batch_size, 1)
    p.at_least("data.val_batch_size", d.val_batch_size, 1)
    p.optional_at_least("data.max_val_samples", d.max_val_samples, 1)
    if not d.prompt_key:
        p.add("data.prompt_key", d.prompt_key, "must name the prompt column")


def check_rollout(p: Problems, r: RolloutConfig) -> None:
    p.at_least("rollout.n", r.n, 1)
    p.at_least("rollout.max_response_length", r.max_response_length, 1)
    if not r.temperature > 0:
        p.add(
            "rollout.temperature",
            r.temperature,
            "must be > 0 (training log-probs divide by it; greedy is val_temperature=0)",
        )
    p.at_least("rollout.val_temperature", r.val_temperature, 0)
    if not 0 < r.top_p <= 1:
        p.add("rollout.top_p", r.top_p, "must be in (0, 1]")
    p.at_least("rollout.top_k", r.top_k, 0)
    component_problems(p, "rollout.engine", r.engine)


def check_agent(p: Problems, ag: AgentConfig, *, ignore_eos: bool, check_files: bool) -> None:
    """Multi-turn rollouts: the section's numbers, then its tools, parser and interactions are imported, built and
    their schemas checked (``rlspmd.agent``: an error names the tool and the field), verl's tool and interaction
    YAML files among them (``check_files``: an error names the file and the entry)."""
    from rlspmd.agent import load_interactions, load_parser, load_tools

    for name in ("max_turns", "max_parallel_tools", "max_tool_response_chars", "max_user_turns"):
        p.at_least(f"rollout.agent.{name}", getattr(ag, name), 1)
    if not ag.tool_timeout_s > 0:
        p.add("rollout.agent.tool_timeout_s", ag.tool_timeout_s, "must be > 0")
    if ignore_eos:
        p.add(
            "rollout.ignore_eos",
            ignore_eos,
            "fixed-length benchmark rollouts do not apply to multi-turn rollouts "
            "(rollout.agent): a turn ends at its stop token",
        )
    if not check_files:  # the YAML files are files: read only when files are checked
        ag = dataclasses.replace(ag, tool_config_path=None, interaction_config_path=None)
    for load in (load_tools, load_parser, load_interactions):
        p.file_check(load, ag)


def check_actor(p: Problems, a: ActorConfig, *, train_batch_size: int, n: int, dp: int) -> None:
    from rlspmd.algorithms import KL_ESTIMATORS

    _trained_role(p, "actor", a, train_batch_size=train_batch_size, n=n, dp=dp)
    p.at_least("actor.logprob_micro_batch_size", a.logprob_micro_batch_size, 1)
    p.optional_at_least("actor.logprob_max_tokens_per_micro_batch", a.logprob_max_tokens_per_micro_batch, 1)
    component_problems(p, "actor.policy_loss", a.policy_loss)
    if a.use_kl_loss:
        p.one_of("actor.kl_loss_type", a.kl_loss_type, KL_ESTIMATORS)
        p.at_least("actor.kl_loss_coef", a.kl_loss_coef, 0)
    check_optim(p, "actor.optim", a.optim)
    check_packing(p, "actor.model", a.model.attn_implementation, a.model.packing)
    _lora(p, a.lora, engine=a.engine)


def check_actor_tp(p: Problems, cfg: Config, *, with_critic: bool, check_files: bool) -> None:
    """Tensor parallelism of the training roles (``mesh.actor_tp``; its divisibility of the ranks is a placement
    check): an engine whose tensor parallelism it is (FSDP), no LoRA, and heads that split (read from config.json when
    files are checked)."""
    tp = cfg.mesh.actor_tp
    if not cfg.actor.engine.supports_mesh_tp:
        p.add(
            "mesh.actor_tp",
            tp,
            f"is the fsdp engine's tensor parallelism; actor.engine:{cfg.actor.engine.name} has its "
            "own (actor.engine.tp)",
        )
    if with_critic and not cfg.critic.engine.supports_mesh_tp:
        p.add(
            "mesh.actor_tp",
            tp,
            f"also applies to the critic, which needs the fsdp engine (critic.engine:{cfg.critic.engine.name})",
        )
    if cfg.actor.lora.enabled:
        p.add(
            "mesh.actor_tp", tp, "is not supported with actor.lora (adapters are not tensor-parallel); use actor_tp=1"
        )
    config_json = Path(cfg.actor.model.path).expanduser() / "config.json"
    if check_files and config_json.is_file():
        c = json.loads(config_json.read_text())
        heads = c.get("num_attention_heads")
        kv = c.get("num_key_value_heads") or heads
        if isinstance(heads, int) and (heads % tp or kv % tp):
            p.add(
                "mesh.actor_tp",
                tp,
                f"must divide the model's {heads} attention heads and {kv} KV heads ({config_json})",
            )


def check_actor_sp(p: Problems, cfg: Config, *, with_critic: bool, check_files: bool) -> None:
    """Sequence parallelism of the training roles (``mesh.actor_sp``; its divisibility of the ranks and its
    combinations with ``actor_tp`` / ``actor_ep`` are placement checks): an engine whose sequence parallelism it is
    (FSDP), packed sequences through rlspmd's attention, a dense text model, and (when files are checked) heads that
    the chosen mode can split: every model the actor, reference and critic load."""
    from rlspmd.distributed.sequence_parallel import resolve_sp_mode
    from rlspmd.models.moe import MOE_MODEL_TYPES
    from rlspmd.models.vision import VISION_MODEL_TYPES

    sp, m = cfg.mesh.actor_sp, cfg.actor.model
    for section, engine in (("actor", cfg.actor.engine), *((("critic", cfg.critic.engine),) if with_critic else ())):
        if not engine.supports_mesh_sp:
            p.add(
                "mesh.actor_sp",
                sp,
                f"is the fsdp engine's sequence parallelism; {section}.engine:{engine.name} has none",
            )
    if not m.packing or m.attn_implementation != "sdpa":
        why = "model.packing=False" if not m.packing else f"attn_implementation={m.attn_implementation!r}"
        p.add(
            "mesh.actor_sp",
            sp,
            "splits packed sequences run by rlspmd's attention (actor.model.packing=True, "
            f"attn_implementation='sdpa'); got {why}",
        )
    if cfg.teacher.enabled:
        p.add(
            "teacher.model_path",
            cfg.teacher.model_path,
            f"a teacher role does not run with mesh.actor_sp={sp} yet: its signals need the vocabulary outputs "
            "(argmax, vocab_logprobs, GKD's JSD) that the split policy forward does not compute; use mesh.actor_sp=1",
        )
    if cfg.algorithm.adv_estimator.uses_sum_pi_squared:
        p.add(
            "algorithm.adv_estimator",
            cfg.algorithm.adv_estimator.name,
            f"needs the sum of squared probabilities over the vocabulary, which the policy forward does not compute "
            f"with mesh.actor_sp={sp} yet; use mesh.actor_sp=1",
        )
    if not check_files:
        return
    models = [("actor.model.path", m.path), ("ref.model_path", cfg.ref.model_path)]
    if with_critic:
        models.append(("critic.model_path", cfg.critic.model_path))
    for field_name, path in models:
        config_json = None if path is None else Path(path).expanduser() / "config.json"
        if config_json is None or not config_json.is_file():
            continue
        c = json.loads(config_json.read_text())
        model_type = c.get("model_type")
        if model_type in MOE_MODEL_TYPES or model_type in VISION_MODEL_TYPES:
            kind = "mixture-of-experts" if model_type in MOE_MODEL_TYPES else "vision-language"
            p.add("mesh.actor_sp", sp, f"does not run {kind} models yet ({field_name}={path}: {model_type})")
            continue
        heads = c.get("num_attention_heads")
        if not isinstance(heads, int):
            continue
        try:
            resolve_sp_mode(
                cfg.mesh.actor_sp_mode, heads=heads, kv_heads=c.get("num_key_value_heads") or heads, sp=sp,
                tp=cfg.mesh.actor_tp,
            )  # fmt: skip
        except ValueError as e:
            p.add("mesh.actor_sp_mode", cfg.mesh.actor_sp_mode, f"{field_name}={path}: {e}")


def _lora(p: Problems, lora: LoraConfig, *, engine) -> None:
    p.at_least("actor.lora.rank", lora.rank, 0)
    if not lora.enabled:
        return
    if not lora.alpha > 0:
        p.add("actor.lora.alpha", lora.alpha, "must be > 0")
    if not 0 <= lora.dropout < 1:
        p.add("actor.lora.dropout", lora.dropout, "must be in [0, 1)")
    if not lora.target_modules:
        p.add("actor.lora.target_modules", lora.target_modules, "must name at least one layer (or all-linear)")
    if not engine.supports_lora:
        p.add(
            "actor.engine",
            engine.name,
            f"actor.lora.rank={lora.rank} needs the fsdp engine (LoRA is not implemented for {engine.name})",
        )


def check_critic(p: Problems, c: CriticConfig, *, train_batch_size: int, n: int, dp: int) -> None:
    _trained_role(p, "critic", c, train_batch_size=train_batch_size, n=n, dp=dp)
    p.at_least("critic.values_micro_batch_size", c.values_micro_batch_size, 1)
    p.optional_at_least("critic.values_max_tokens_per_micro_batch", c.values_max_tokens_per_micro_batch, 1)
    if c.cliprange_value is not None and not c.cliprange_value > 0:
        p.add("critic.cliprange_value", c.cliprange_value, "must be > 0, or None (off)")
    p.at_least("critic.warmup_steps", c.warmup_steps, 0)
    check_optim(p, "critic.optim", c.optim)


def check_algorithm(p: Problems, alg: AlgorithmConfig, *, train_batch_size: int, n: int, dp: int) -> None:
    from rlspmd.algorithms import KL_ESTIMATORS

    component_problems(p, "algorithm.adv_estimator", alg.adv_estimator)
    if alg.use_kl_in_reward:
        p.one_of("algorithm.kl_penalty", alg.kl_penalty, KL_ESTIMATORS)
        component_problems(p, "algorithm.kl_ctrl", alg.kl_ctrl)
    for name, value, why in alg.rollout_correction.problems():
        p.add(f"algorithm.rollout_correction.{name}", value, why)
    fg = alg.filter_groups
    if fg.enable:
        gen = fg.gen_batch_size or train_batch_size
        if gen < train_batch_size:
            p.add("algorithm.filter_groups.gen_batch_size", gen, f"must be >= data.train_batch_size={train_batch_size}")
        elif dp and gen % dp:
            p.add("algorithm.filter_groups.gen_batch_size", gen, f"does not split over the actor's {dp} DP ranks")
        p.at_least("algorithm.filter_groups.max_rounds", fg.max_rounds, 1)
        if n < 2:
            p.add(
                "rollout.n",
                n,
                "dynamic sampling (algorithm.filter_groups.enable) needs >= 2: a single sample never varies",
            )


def component_problems(p: Problems, field: str, component) -> None:
    """A component's own checks (a loss, an estimator, an engine, ...), named by where it sits and which it is."""
    for name, value, why in component.problems():
        p.add(f"{field}.{name}", value, f"{why} ({component.name})")


def check_reward(p: Problems, rw: RewardConfig, *, max_response_length: int, agent: bool, needed: bool = True) -> None:
    # multi-turn rollouts (rollout.agent) bring their own reward (tool deltas, final tool states, interactions); an
    # estimator that reads no reward (pure distillation) needs none
    if needed and rw.model.path is None and rw.rule_weight == 0 and not agent:
        p.add(
            "reward.rule_weight",
            rw.rule_weight,
            "0 without a reward model (reward.model.path) or rollout.agent leaves no reward at all",
        )
    if rw.model.path is not None:
        p.at_least("reward.model.micro_batch_size", rw.model.micro_batch_size, 1)
        p.optional_at_least("reward.model.max_tokens_per_micro_batch", rw.model.max_tokens_per_micro_batch, 1)
    if rw.overlong_buffer.enable:
        if not 0 < rw.overlong_buffer.len <= max_response_length:
            p.add(
                "reward.overlong_buffer.len",
                rw.overlong_buffer.len,
                f"must be in (0, rollout.max_response_length={max_response_length}]",
            )
        p.at_least("reward.overlong_buffer.penalty_factor", rw.overlong_buffer.penalty_factor, 0)
    if rw.timeout_s is not None and not rw.timeout_s > 0:
        p.add("reward.timeout_s", rw.timeout_s, "must be > 0, or None (no limit: functions run in this process)")
    p.at_least("reward.num_workers", rw.num_workers, 0)


def check_gdpo(p: Problems, alg: AlgorithmConfig, rw: RewardConfig, *, agent: bool) -> None:
    """Reward components have distinct names (their metrics and columns), and GDPO's weights one per column."""
    from rlspmd.roles.reward import component_columns

    columns = component_columns(rw, agent=agent)
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        p.add(
            "reward.components",
            rw.components,
            f"name the function(s) {repeated} twice (or as a built-in column: "
            "task_score, rm_score); each component needs a name of its own",
        )
    weights = alg.adv_estimator.reward_weights if isinstance(alg.adv_estimator, GDPO) else None
    if weights is not None and len(weights) != len(columns):
        p.add(
            "algorithm.adv_estimator.reward_weights",
            weights,
            f"needs one weight per reward component: {len(columns)} "
            f"columns {columns} (the rule score, the reward model's with reward.model.path, the agent's with "
            "rollout.agent, then reward.components)",
        )


def check_checkpoint(p: Problems, c: CheckpointConfig, *, check_files: bool) -> None:
    from rlspmd.trainer.checkpoint import config_problems, resolve_checkpoint

    for name, value, why in config_problems(c):
        p.add(f"checkpoint.{name}", value, why)
    resume = c.resume.strip()
    if check_files and resume not in ("auto", "none"):
        p.file_check(resolve_checkpoint, resume, field_name="checkpoint.resume")


def check_placement(p: Problems, mesh: MeshConfig, *, world_size: int, engine: RolloutEngineConfig) -> tuple[int, bool]:
    """The placements the RL trainer runs (colocated, or the rollout on ranks of its own); the actor's DP size
    (0 when the placement itself is invalid) and whether the placement is split."""
    from rlspmd.distributed.mesh import ParallelDims

    try:
        dims = ParallelDims.from_config(mesh, world_size)  # the reference, critic and reward model follow the actor
    except ValueError as e:
        p.lines.append(str(e))
        return 0, False
    actor = dims.role_ranks["actor"]
    if 0 not in actor:
        p.add(
            "mesh.actor_ranks", mesh.actor_ranks, f"must include rank 0 (it reads the data and logs); got ranks {actor}"
        )
    rollout = dims.role_ranks["rollout"]
    split = dims.disjoint("actor", "rollout")
    if rollout != actor and not split:
        p.add(
            "mesh.rollout_ranks",
            mesh.rollout_ranks,
            f"ranks {rollout} must equal the actor's ranks {actor} (colocated) or share none with them (split)",
        )
    idle = sorted(set(range(world_size)) - set(actor) - set(rollout))
    if idle:
        p.add(
            "mesh.actor_ranks",
            mesh.actor_ranks,
            f"ranks {idle} of the {world_size} host no role: extend mesh.actor_ranks or mesh.rollout_ranks",
        )
    if split and engine.colocated_only:
        p.add("rollout.engine", engine.name, engine.colocated_only)
    return dims.dp_size("actor"), split


def check_staleness(p: Problems, max_staleness: int, *, split: bool, alg: AlgorithmConfig) -> None:
    """Asynchronous RL overlaps generation on the rollout ranks with training on the actor's: it needs them apart, and
    a step whose generation depends on its own batch (dynamic sampling's extra rounds, ReMax's greedy baseline of the
    same prompts) cannot be generated a step ahead."""
    p.at_least("trainer.max_staleness", max_staleness, 0)
    if max_staleness < 1:
        return
    if not split:
        p.add(
            "trainer.max_staleness",
            max_staleness,
            "asynchronous RL needs split placement (mesh.actor_ranks and "
            "mesh.rollout_ranks on different ranks): colocated, generation and training share the devices",
        )
    if alg.filter_groups.enable:
        p.add(
            "trainer.max_staleness",
            max_staleness,
            "does not combine with dynamic sampling (algorithm.filter_groups."
            "enable): its extra generation rounds depend on the batch being trained",
        )
    if alg.adv_estimator.uses_greedy_baseline:
        p.add(
            "trainer.max_staleness",
            max_staleness,
            f"does not combine with algorithm.adv_estimator="
            f"{alg.adv_estimator.name!r}, whose greedy baseline generates the trained batch's own prompts",
        )


def check_bypass_mode(p: Problems, cfg: Config, *, split: bool) -> None:
    """Bypass mode (``algorithm.rollout_correction.bypass``: the rollout's log-probs are the old log-probs) needs one
    optimiser update per step and the correction on. ``mode=auto`` is resolved here as the builder will resolve it
    (engine, rollout dtype, the actor's compute dtype on this machine's device, placement, staleness), so an ``auto``
    that turns the correction off is caught before anything loads."""
    if not cfg.algorithm.rollout_correction.bypass:
        return
    import torch

    from rlspmd.roles.rollout_correction import check_bypass
    from rlspmd.trainer.build_rollout import build_rollout_correction

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # as rlspmd.distributed.runtime picks it
    resolved = build_rollout_correction(cfg, compute=cfg.actor.engine.compute_dtype(device), split=split)
    a = cfg.actor
    try:
        check_bypass(
            resolved,
            ppo_epochs=a.ppo_epochs,
            mini_batch_size=a.mini_batch_size,
            train_batch_size=cfg.data.train_batch_size,
        )
    except ValueError as e:  # its message names the fields
        p.lines.append(str(e))


def _trained_role(
    p: Problems, role: str, section: TrainedRoleConfig, *, train_batch_size: int, n: int, dp: int
) -> None:
    """What the actor and the critic share: the engine, the loss aggregation, epochs, mini- and micro-batch sizes, and
    how the step's batch splits into them."""
    from rlspmd.algorithms import AGG_MODES

    component_problems(p, f"{role}.engine", section.engine)
    p.at_least(f"{role}.ppo_epochs", section.ppo_epochs, 1)
    p.at_least(f"{role}.mini_batch_size", section.mini_batch_size, 1)
    p.at_least(f"{role}.micro_batch_size", section.micro_batch_size, 1)
    p.optional_at_least(f"{role}.max_tokens_per_micro_batch", section.max_tokens_per_micro_batch, 1)
    p.one_of(f"{role}.loss_agg_mode", section.loss_agg_mode, AGG_MODES)
    mini = section.mini_batch_size
    if train_batch_size < 1 or mini < 1 or n < 1 or dp < 1:
        return  # reported above
    if role == "actor" and train_batch_size % dp:
        p.add("data.train_batch_size", train_batch_size, f"does not split over the actor's {dp} DP ranks")
    if train_batch_size % mini:
        p.add(
            f"{role}.mini_batch_size",
            mini,
            f"does not divide data.train_batch_size={train_batch_size} (prompts per step)",
        )
    elif (mini * n) % dp:
        p.add(
            f"{role}.mini_batch_size",
            mini,
            f"x rollout.n={n} = {mini * n} samples per mini-batch do not split over the actor's {dp} DP ranks",
        )


def check_optim(p: Problems, name: str, o: OptimConfig) -> None:
    p.at_least(f"{name}.lr", o.lr, 0)
    p.at_least(f"{name}.weight_decay", o.weight_decay, 0)
    if not all(0 <= b < 1 for b in o.betas):
        p.add(f"{name}.betas", o.betas, "each must be in [0, 1)")
    if not o.eps > 0:
        p.add(f"{name}.eps", o.eps, "must be > 0")
    p.at_least(f"{name}.warmup_steps", o.warmup_steps, 0)
    if not 0 <= o.min_lr_ratio <= 1:
        p.add(f"{name}.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")


def check_packing(p: Problems, name: str, attn: str, packing: bool) -> None:
    if packing and not (attn == "sdpa" or attn.startswith("flash_attention")):
        p.add(
            f"{name}.attn_implementation",
            attn,
            f"cannot run packed sequences; use sdpa or flash_attention_2, or set {name}.packing=False",
        )


def check_dist(p: Problems, dist_cfg: DistConfig) -> None:
    if not dist_cfg.timeout_s > 0:
        p.add("dist.timeout_s", dist_cfg.timeout_s, "must be > 0")
    p.at_least("dist.hang_warn_s", dist_cfg.hang_warn_s, 0)
    p.at_least("dist.hang_timeout_s", dist_cfg.hang_timeout_s, 0)


def check_loggers(p: Problems, name: str, loggers: list[str], cfg: TrackerConfig, *, tracking: str) -> None:
    unknown = sorted(set(loggers) - set(LOGGERS))
    if unknown:
        p.add(name, loggers, f"unknown sink(s) {unknown}; choose from {list(LOGGERS)}")
    for tracker, pip in missing_packages(loggers):
        p.add(name, loggers, f"{tracker} is not installed here: {pip}")
    for field, value, why in cfg.problems():
        p.add(f"{tracking}.{field}", value, why)


def check_teacher(p: Problems, cfg: Config, *, split: bool) -> None:
    """The teacher section and what it, and the estimator, need from the rest of the run
    (``rlspmd/algorithms/distill.py``; its files with the others in ``files.py``)."""
    from rlspmd.algorithms.distill import teacher_run_problems

    t, est, engine = cfg.teacher, cfg.algorithm.adv_estimator, cfg.actor.engine
    if t.enabled:
        for name, value, why in t.problems():
            p.add(f"teacher.{name}", value, why)
        component_problems(p, "teacher.signal", t.signal)
    for name, value, why in teacher_run_problems(
        t,
        uses_reward=est.uses_reward,
        estimator=est.name,
        vocab_outputs=engine.vocab_outputs,
        engine=engine.name,
        actor_tp=cfg.mesh.actor_tp,
        filter_groups=cfg.algorithm.filter_groups.enable,
    ):
        p.add(name, value, why)
    if est.uses_sum_pi_squared and not engine.vocab_outputs:
        p.add(
            "algorithm.adv_estimator",
            est.name,
            f"needs the sum of squared probabilities over the vocabulary, which actor.engine:{engine.name} does not "
            "compute; use fsdp",
        )
    if est.uses_sum_pi_squared and cfg.algorithm.rollout_correction.bypass:
        p.add(
            "algorithm.rollout_correction.bypass",
            True,
            f"skips the old-log-prob forward, where {est.name} gets the sum of squared probabilities",
        )
