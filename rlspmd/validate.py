"""One pass over the configuration, on every rank, before anything heavy loads.

Everything knowable from the config alone is checked here, right after parsing: sizes that must be positive,
batch sizes that must divide (by mini-batches, by DP ranks), names that must be known (losses, estimators, loggers,
``Literal`` fields set from a config file), role placement, and the files and functions that must exist (model and
tokenizer directories, with every safetensors header; data files; the reward function, found without running the
user's code). Every problem is collected and reported at once, one line each, naming the field and its value.

Every rank runs the same checks on the same config, so every rank fails (or passes) together, before any
collective. Checks that need the data or the model (prompt lengths, chat template, data sources) stay where the data
and the model are read.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.machinery
import importlib.util
import json
import types
import typing
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
    FilterGroupsConfig,
    FixedKL,
    LoraConfig,
    MeshConfig,
    OptimConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    SFTConfig,
    TeacherConfig,
    TrainedRoleConfig,
)
from rlspmd.components import Component
from rlspmd.rollout.base import RolloutEngineConfig
from rlspmd.distributed.runtime import UserError

LOGGERS = ("console", "jsonl", "tensorboard")


class ConfigError(UserError):
    """The configuration cannot run; the message lists every problem found, one per line."""


class Problems:
    def __init__(self):
        self.lines: list[str] = []

    def add(self, field: str, value, why: str) -> None:
        self.lines.append(f"{field}={value!r}: {why}")

    def at_least(self, field: str, value, low) -> None:
        if value < low:
            self.add(field, value, f"must be >= {low}")

    def optional_at_least(self, field: str, value, low) -> None:
        if value is not None and value < low:
            self.add(field, value, f"must be >= {low}, or None (off)")

    def one_of(self, field: str, value, known) -> None:
        if value not in known:
            self.add(field, value, f"must be one of {sorted(known)}")

    def file_check(self, check, *args, **kwargs) -> None:
        """Run a loader's file check; its error message already names the field and the path."""
        try:
            check(*args, **kwargs)
        except (OSError, ValueError) as e:
            self.lines.append(str(e))


def check_config(cfg: Config, *, world_size: int, check_files: bool = True) -> None:
    """Raise ``ConfigError`` listing every problem of an RL config for a world of ``world_size`` ranks."""
    _raise(config_problems(cfg, world_size=world_size, check_files=check_files))


def check_sft_config(cfg: SFTConfig, *, world_size: int, check_files: bool = True) -> None:
    """Raise ``ConfigError`` listing every problem of an SFT config."""
    _raise(sft_config_problems(cfg, world_size=world_size, check_files=check_files))


def _raise(lines: list[str]) -> None:
    if lines:
        n = len(lines)
        raise ConfigError(
            f"invalid configuration ({n} problem{'s' if n > 1 else ''}; nothing was loaded):\n  " + "\n  ".join(lines)
        )


def config_problems(cfg: Config, *, world_size: int, check_files: bool = True) -> list[str]:
    """Every problem of an RL config, one line each (empty: it can run). The sections are checked by the functions
    below, each given the sections it reads; batch arithmetic needs the actor's DP size from the placement."""
    p = Problems()
    _types(p, cfg, "")
    if p.lines:  # the checks below compare and divide: they need values of the right types
        return p.lines
    dp, split = _placement(p, cfg.mesh, world_size=world_size, engine=cfg.rollout.engine)
    d, r = cfg.data, cfg.rollout
    with_critic = cfg.algorithm.adv_estimator.uses_critic
    _data(p, d)
    _rollout(p, r)
    if r.agent.enabled:
        _agent(p, r.agent, ignore_eos=r.ignore_eos, check_files=check_files)
    _actor(p, cfg.actor, train_batch_size=d.train_batch_size, n=r.n, dp=dp)
    p.at_least("ref.logprob_micro_batch_size", cfg.ref.logprob_micro_batch_size, 1)
    if cfg.actor.lora.enabled and cfg.ref.model_path not in (None, cfg.actor.model.path):
        p.add(
            "ref.model_path",
            cfg.ref.model_path,
            f"with actor.lora the reference is the actor's base model "
            f"({cfg.actor.model.path}, adapters off); leave ref.model_path unset",
        )
    p.optional_at_least("ref.logprob_max_tokens_per_micro_batch", cfg.ref.logprob_max_tokens_per_micro_batch, 1)
    if with_critic:
        _critic(p, cfg.critic, train_batch_size=d.train_batch_size, n=r.n, dp=dp)
    if cfg.mesh.actor_tp > 1:
        _actor_tp(p, cfg, with_critic=with_critic, check_files=check_files)
    _algorithm(p, cfg.algorithm, train_batch_size=d.train_batch_size, n=r.n, dp=dp)
    _reward(
        p,
        cfg.reward,
        max_response_length=r.max_response_length,
        agent=r.agent.enabled,
        needed=cfg.algorithm.adv_estimator.uses_reward,
    )
    _teacher(p, cfg, split=split)
    _gdpo(p, cfg.algorithm, cfg.reward, agent=r.agent.enabled)
    _dist(p, cfg.dist)
    t = cfg.trainer
    p.at_least("trainer.total_steps", t.total_steps, 1)
    p.at_least("trainer.val_every", t.val_every, 0)
    if not 0 <= t.stop_at_step <= t.total_steps:
        p.add("trainer.stop_at_step", t.stop_at_step, f"must be in [0, trainer.total_steps={t.total_steps}]")
    _loggers(p, "trainer.loggers", t.loggers)
    p.at_least("trainer.samples.num_train", t.samples.num_train, 0)
    p.at_least("trainer.samples.num_val", t.samples.num_val, 0)
    for i, stage in enumerate(t.stages):
        _component(p, f"trainer.stages[{i}]", stage)
    _staleness(p, t.max_staleness, split=split, alg=cfg.algorithm)
    _bypass(p, cfg, split=split)
    _checkpoint(p, cfg.checkpoint, check_files=check_files)
    if check_files:
        _files(p, cfg, with_critic=with_critic)
        _context(p, cfg, with_critic=with_critic)
    return p.lines


def sft_config_problems(cfg: SFTConfig, *, world_size: int, check_files: bool = True) -> list[str]:
    p = Problems()
    _types(p, cfg, "")
    if p.lines:
        return p.lines
    d = cfg.data
    if not d.train_files:
        p.add("data.train_files", d.train_files, "give at least one parquet or jsonl file")
    p.at_least("data.max_length", d.max_length, 1)
    p.at_least("data.batch_size", d.batch_size, 1)
    if d.batch_size >= 1 and d.batch_size % world_size:
        p.add(
            "data.batch_size",
            d.batch_size,
            f"does not split over {world_size} DP ranks (every rank is a DP rank in SFT)",
        )
    p.at_least("micro_batch_size", cfg.micro_batch_size, 1)
    p.at_least("total_steps", cfg.total_steps, 1)
    if not 0 <= cfg.stop_at_step <= cfg.total_steps:
        p.add("stop_at_step", cfg.stop_at_step, f"must be in [0, total_steps={cfg.total_steps}]")
    p.at_least("log_every", cfg.log_every, 1)
    _optim(p, "optim", cfg.optim)
    _packing(p, "model", cfg.model.attn_implementation, cfg.model.packing)
    _dist(p, cfg.dist)
    _loggers(p, "loggers", cfg.loggers)
    _checkpoint(p, cfg.checkpoint, check_files=check_files)
    if d.tools:  # demonstrations rendered with tool schemas: the tools must build as the RL run builds them
        from rlspmd.agent import load_tools

        p.file_check(load_tools, AgentConfig(tools=d.tools), field_name="data.tools")
    if check_files:
        _model_files(p, "model", cfg.model.path, tokenizer=cfg.model.tokenizer_path or cfg.model.path)
        _data_files(p, "data.train_files", d.train_files)
    return p.lines


# -- sections ---------------------------------------------------------------------------------------------


def _data(p: Problems, d: DataConfig) -> None:
    for name, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if not files:
            p.add(name, files, "give at least one parquet or jsonl file")
    p.at_least("data.max_prompt_length", d.max_prompt_length, 1)
    p.at_least("data.train_batch_size", d.train_batch_size, 1)
    p.at_least("data.val_batch_size", d.val_batch_size, 1)
    p.optional_at_least("data.max_val_samples", d.max_val_samples, 1)
    if not d.prompt_key:
        p.add("data.prompt_key", d.prompt_key, "must name the prompt column")


def _rollout(p: Problems, r: RolloutConfig) -> None:
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
    _component(p, "rollout.engine", r.engine)


def _agent(p: Problems, ag: AgentConfig, *, ignore_eos: bool, check_files: bool) -> None:
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


def _actor(p: Problems, a: ActorConfig, *, train_batch_size: int, n: int, dp: int) -> None:
    from rlspmd.algorithms import KL_ESTIMATORS

    _trained_role(p, "actor", a, train_batch_size=train_batch_size, n=n, dp=dp)
    p.at_least("actor.logprob_micro_batch_size", a.logprob_micro_batch_size, 1)
    p.optional_at_least("actor.logprob_max_tokens_per_micro_batch", a.logprob_max_tokens_per_micro_batch, 1)
    _component(p, "actor.policy_loss", a.policy_loss)
    if a.use_kl_loss:
        p.one_of("actor.kl_loss_type", a.kl_loss_type, KL_ESTIMATORS)
        p.at_least("actor.kl_loss_coef", a.kl_loss_coef, 0)
    _optim(p, "actor.optim", a.optim)
    _packing(p, "actor.model", a.model.attn_implementation, a.model.packing)
    _lora(p, a.lora, engine=a.engine)


def _actor_tp(p: Problems, cfg: Config, *, with_critic: bool, check_files: bool) -> None:
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


def _critic(p: Problems, c: CriticConfig, *, train_batch_size: int, n: int, dp: int) -> None:
    _trained_role(p, "critic", c, train_batch_size=train_batch_size, n=n, dp=dp)
    p.at_least("critic.values_micro_batch_size", c.values_micro_batch_size, 1)
    p.optional_at_least("critic.values_max_tokens_per_micro_batch", c.values_max_tokens_per_micro_batch, 1)
    if c.cliprange_value is not None and not c.cliprange_value > 0:
        p.add("critic.cliprange_value", c.cliprange_value, "must be > 0, or None (off)")
    p.at_least("critic.warmup_steps", c.warmup_steps, 0)
    _optim(p, "critic.optim", c.optim)


def _algorithm(p: Problems, alg: AlgorithmConfig, *, train_batch_size: int, n: int, dp: int) -> None:
    from rlspmd.algorithms import KL_ESTIMATORS

    _component(p, "algorithm.adv_estimator", alg.adv_estimator)
    if alg.use_kl_in_reward:
        p.one_of("algorithm.kl_penalty", alg.kl_penalty, KL_ESTIMATORS)
        _component(p, "algorithm.kl_ctrl", alg.kl_ctrl)
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


def _component(p: Problems, field: str, component) -> None:
    """A component's own checks (a loss, an estimator, an engine, ...), named by where it sits and which it is."""
    for name, value, why in component.problems():
        p.add(f"{field}.{name}", value, f"{why} ({component.name})")


def _reward(p: Problems, rw: RewardConfig, *, max_response_length: int, agent: bool, needed: bool = True) -> None:
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


def _gdpo(p: Problems, alg: AlgorithmConfig, rw: RewardConfig, *, agent: bool) -> None:
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
            f"columns {columns} (the rule score, the reward model's with reward.model.path, the agent's with rollout.agent, then reward.components)",
        )


def _teacher(p: Problems, cfg: Config, *, split: bool) -> None:
    """The teacher section and what it, and the estimator, need from the rest of the run
    (``rlspmd/algorithms/distill.py``; its files with the others in ``_files``)."""
    from rlspmd.algorithms.distill import teacher_run_problems

    t, est, engine = cfg.teacher, cfg.algorithm.adv_estimator, cfg.actor.engine
    if t.enabled:
        for name, value, why in t.problems():
            p.add(f"teacher.{name}", value, why)
        _component(p, "teacher.signal", t.signal)
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


def _files(p: Problems, cfg: Config, *, with_critic: bool) -> None:
    """Model, tokenizer and data files, the reward function, the checkpoint to resume: every path the run reads."""
    a, rw = cfg.actor, cfg.reward
    _model_files(p, "actor.model", a.model.path, tokenizer=a.model.tokenizer_path or a.model.path)
    if (
        cfg.ref.model_path is not None
    ):  # the reference and the critic read the actor's tokens: no tokenizer of their own
        _model_files(p, "ref.model_path", cfg.ref.model_path, tokenizer=None)
    if with_critic and cfg.critic.model_path is not None:
        _model_files(p, "critic.model_path", cfg.critic.model_path, tokenizer=None)
    if cfg.teacher.enabled:
        _teacher_files(p, cfg)
    if rw.model.path is not None:
        _model_files(p, "reward.model", rw.model.path, tokenizer=rw.model.tokenizer_path or rw.model.path)
    _data_files(p, "data.train_files", cfg.data.train_files)
    _data_files(p, "data.val_files", cfg.data.val_files)
    if rw.function is not None:
        p.file_check(check_function_spec, rw.function, field_name="reward.function")
    for i, spec in enumerate(rw.components):
        p.file_check(check_function_spec, spec, field_name=f"reward.components[{i}]")


def _teacher_files(p: Problems, cfg: Config) -> None:
    """The teacher's directory, its tokenizer against the student's (the same token ids, before any weights load) and,
    for a signal over the whole vocabulary, the same vocabulary size."""
    from rlspmd.models.loader import check_same_tokenizer

    path, a = cfg.teacher.model_path, cfg.actor.model
    _model_files(p, "teacher.model_path", path, tokenizer=None)
    if not Path(path).expanduser().is_dir():
        return  # reported once, above
    student_field = "actor.model.tokenizer_path" if a.tokenizer_path else "actor.model.path"
    p.file_check(
        check_same_tokenizer,
        path,
        field_name="teacher.model_path",
        student=a.tokenizer_path or a.path,
        student_field=student_field,
    )
    if cfg.teacher.signal.full_vocab:
        sizes = {f: _vocab_size(q) for f, q in (("teacher.model_path", path), ("actor.model.path", a.path))}
        if None not in sizes.values() and len(set(sizes.values())) > 1:
            p.add(
                "teacher.model_path",
                path,
                f"has vocab_size={sizes['teacher.model_path']} in its config.json, the student "
                f"{sizes['actor.model.path']}: teacher.signal:{cfg.teacher.signal.name} compares the whole "
                "distributions, which needs the same number of logits",
            )


def _vocab_size(path: str) -> int | None:
    try:
        c = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = c.get("vocab_size") or (c.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def _checkpoint(p: Problems, c: CheckpointConfig, *, check_files: bool) -> None:
    from rlspmd.trainer.checkpoint import config_problems, resolve_checkpoint

    for name, value, why in config_problems(c):
        p.add(f"checkpoint.{name}", value, why)
    resume = c.resume.strip()
    if check_files and resume not in ("auto", "none"):
        p.file_check(resolve_checkpoint, resume, field_name="checkpoint.resume")


def model_context(path: str) -> int | None:
    """The longest sequence a model directory's ``config.json`` allows (``max_position_embeddings``, also under a
    multimodal ``text_config``); None when the file or the field is absent (the model-file check reports a missing
    directory)."""
    config_json = Path(path).expanduser() / "config.json"
    try:
        c = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    for section in (c, c.get("text_config") or {}):
        limit = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


def _context(p: Problems, cfg: Config, *, with_critic: bool) -> None:
    """Every sequence the run builds, the prompt (``data.max_prompt_length``, tool schemas rendered in) plus the
    response (``rollout.max_response_length``; in a multi-turn run the whole conversation after the prompt: the model's
    turns, tool results and user turns), must fit the context of each model that reads it. Past it, positions run off
    the model's table (RoPE past its trained range) and nothing would say so. A prompt longer than
    ``data.max_prompt_length`` is dropped or reported with its file and row when the data loads."""
    d, r = cfg.data, cfg.rollout
    total = d.max_prompt_length + r.max_response_length
    what = (
        "the whole conversation after the prompt: model turns, tool results, user turns"
        if r.agent.enabled
        else "the generated tokens"
    )
    models = [
        ("actor.model.path", cfg.actor.model.path),
        ("ref.model_path", cfg.ref.model_path),
        ("teacher.model_path", cfg.teacher.model_path),
    ]
    if with_critic:
        models.append(("critic.model_path", cfg.critic.model_path))
    for field, path in models:
        limit = None if path is None else model_context(path)
        if limit is not None and total > limit:
            p.add(
                "data.max_prompt_length",
                d.max_prompt_length,
                f"+ rollout.max_response_length={r.max_response_length} ({what}) = {total} tokens exceeds the context of "
                f"{field}={path!r} (max_position_embeddings={limit} in its config.json); lower one of them so their sum "
                f"is <= {limit}",
            )
    path = cfg.actor.model.path
    for name, value, why in r.engine.context_problems(model_path=path, model_context=model_context(path)):
        p.add(f"rollout.engine.{name}", value, why)


def _placement(p: Problems, mesh: MeshConfig, *, world_size: int, engine: RolloutEngineConfig) -> tuple[int, bool]:
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


def _staleness(p: Problems, max_staleness: int, *, split: bool, alg: AlgorithmConfig) -> None:
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


def _bypass(p: Problems, cfg: Config, *, split: bool) -> None:
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

    _component(p, f"{role}.engine", section.engine)
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


def _optim(p: Problems, name: str, o: OptimConfig) -> None:
    p.at_least(f"{name}.lr", o.lr, 0)
    p.at_least(f"{name}.weight_decay", o.weight_decay, 0)
    if not all(0 <= b < 1 for b in o.betas):
        p.add(f"{name}.betas", o.betas, "each must be in [0, 1)")
    if not o.eps > 0:
        p.add(f"{name}.eps", o.eps, "must be > 0")
    p.at_least(f"{name}.warmup_steps", o.warmup_steps, 0)
    if not 0 <= o.min_lr_ratio <= 1:
        p.add(f"{name}.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")


def _packing(p: Problems, name: str, attn: str, packing: bool) -> None:
    if packing and not (attn == "sdpa" or attn.startswith("flash_attention")):
        p.add(
            f"{name}.attn_implementation",
            attn,
            f"cannot run packed sequences; use sdpa or flash_attention_2, or set {name}.packing=False",
        )


def _dist(p: Problems, dist_cfg: DistConfig) -> None:
    if not dist_cfg.timeout_s > 0:
        p.add("dist.timeout_s", dist_cfg.timeout_s, "must be > 0")
    p.at_least("dist.hang_warn_s", dist_cfg.hang_warn_s, 0)
    p.at_least("dist.hang_timeout_s", dist_cfg.hang_timeout_s, 0)


def _loggers(p: Problems, name: str, loggers: list[str]) -> None:
    unknown = sorted(set(loggers) - set(LOGGERS))
    if unknown:
        p.add(name, loggers, f"unknown sink(s) {unknown}; choose from {list(LOGGERS)}")


def _types(p: Problems, cfg, prefix: str) -> None:
    """Every field holds a value of its annotated type (``Literal[...]`` fields one of their values). tyro checks the
    command line; a Python config can set anything, and a string where a number belongs would otherwise run."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        name, value, hint = f"{prefix}{f.name}", getattr(cfg, f.name), hints[f.name]
        if _matches(value, hint):
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                _types(p, value, f"{name}.")  # a section, or the component a union field holds
        elif typing.get_origin(hint) is typing.Literal:
            p.add(name, value, f"must be one of {list(typing.get_args(hint))}")
        else:
            p.add(name, value, f"must be {_type_name(hint)}, not {type(value).__name__}")


def _matches(value, hint) -> bool:
    """``value`` is an instance of the annotation ``hint`` (ints pass for floats, bools pass only for bools, a
    tuple passes for a list)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, (list, tuple) if origin is list else origin):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and (
            not args or all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint) if isinstance(origin or hint, type) else True


def _type_name(hint) -> str:
    """The annotation ``hint`` as an error message names it: ``float``, ``int or None``, ``list[str]``,
    ``one of ['a', 'b'] or None``, ``a policy loss (PPOClip, CISPO, ...)`` for a component's kind."""
    if isinstance(hint, type) and issubclass(hint, Component) and "registry" in vars(hint):
        reg = hint.registry
        article = "an" if reg.kind[0] in "aeiou" else "a"
        return f"{article} {reg.kind} ({', '.join(reg[n].__name__ for n in reg)})"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {list(typing.get_args(hint))}"
    if typing.get_args(hint):  # a parametrised type (list[str], tuple[float, float]): as Python writes it
        return str(hint)
    return getattr(hint, "__name__", str(hint))


def _model_files(p: Problems, name: str, path: str, *, tokenizer: str | None) -> None:
    """A model directory (config, weights with sound safetensors headers) and, where the role reads text, its
    tokenizer files (the chat template is checked when the tokenizer loads)."""
    from rlspmd.models.loader import check_model_dir, check_tokenizer_dir

    field = name if name.endswith("model_path") else f"{name}.path"
    p.file_check(check_model_dir, path, field_name=field)
    if tokenizer is None:
        return
    tok_field = field if tokenizer == path else f"{name}.tokenizer_path"
    if tokenizer != path or Path(path).expanduser().is_dir():  # a missing model directory is reported once
        p.file_check(check_tokenizer_dir, tokenizer, field_name=tok_field)


def _data_files(p: Problems, name: str, files: list[str]) -> None:
    from rlspmd.data.prompts import check_data_file

    for f in files:
        p.file_check(check_data_file, f, field_name=name)


# -- the reward function, without running it ----------------------------------------------------------------


def check_function_spec(spec: str, *, field_name: str) -> None:
    """A registered reward function's name, or ``path/to/file.py:fn`` / ``package.module:fn`` naming a file or module
    that exists and binds ``fn`` at its top level. Found and parsed, never imported: importing runs the user's code,
    which belongs to the run. A module whose names cannot be known without running it (a ``*`` import, a module
    ``__getattr__``) passes."""
    from rlspmd.rewards.rules import REWARD_FUNCTIONS
    from rlspmd.utils.imports import load_object, split_spec  # the same spec syntax as the loader that imports it later

    if spec in REWARD_FUNCTIONS:
        return
    if ":" not in str(spec):  # neither a name nor a path: the loader's own message, nothing imported
        load_object(spec, field_name=field_name, kind="callable", registered=REWARD_FUNCTIONS.names())
    target, name = split_spec(spec, field_name=field_name, example="function")
    if target.endswith(".py"):
        source = Path(target).expanduser()
        if not source.is_file():
            raise FileNotFoundError(f"{field_name}: file {source} does not exist")
    else:
        source = _module_source(target, spec=spec, field_name=field_name)
        if source is None:  # a compiled or namespace module: nothing to read
            return
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except SyntaxError as e:
        raise ValueError(f"{field_name}={spec!r}: {source} line {e.lineno}: SyntaxError: {e.msg}") from None
    names = _top_level_names(tree.body)
    if name not in names and "*" not in names and "__getattr__" not in names:
        raise ValueError(f"{field_name}={spec!r}: {source} has no function {name!r}")


def _module_source(dotted: str, *, spec: str, field_name: str) -> Path | None:
    """The source file of ``a.b.c``, located package by package without importing (and so running) any of them."""
    parts = dotted.split(".")
    found = None
    path = None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        found = importlib.machinery.PathFinder.find_spec(name, path)
        if found is None and i == 0:  # a module that is not on sys.path: frozen or built in
            found = importlib.util.find_spec(name)
        if found is None:
            raise ValueError(f"{field_name}={spec!r}: cannot find module {name!r} (not on the Python path)")
        path = found.submodule_search_locations
    origin = found.origin if found is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    """Names a module binds at its top level (inside top-level if/try/with blocks too)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.If):
            names |= _top_level_names(node.body) | _top_level_names(node.orelse)
        elif isinstance(node, ast.With):
            names |= _top_level_names(node.body)
        elif isinstance(node, ast.Try):
            names |= _top_level_names(node.body) | _top_level_names(node.orelse) | _top_level_names(node.finalbody)
            for handler in node.handlers:
                names |= _top_level_names(handler.body)
    return names


# -- settings that do nothing --------------------------------------------------------------------------------------


def ignored_settings(cfg: Config) -> list[str]:
    """Settings that differ from their defaults but do nothing under the switches that gate them (warned once)."""
    alg, out = cfg.algorithm, []
    if not alg.adv_estimator.uses_critic and cfg.critic != CriticConfig():
        out.append(f"critic.* is set but algorithm.adv_estimator={alg.adv_estimator.name!r} uses no critic")
    if not alg.use_kl_in_reward and (alg.kl_ctrl != FixedKL() or alg.kl_penalty != AlgorithmConfig.kl_penalty):
        out.append("algorithm.kl_ctrl / kl_penalty are set but algorithm.use_kl_in_reward=False")
    if not alg.filter_groups.enable and alg.filter_groups != FilterGroupsConfig():
        out.append("algorithm.filter_groups.* is set but algorithm.filter_groups.enable=False")
    if not cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer != OverlongBufferConfig():
        out.append("reward.overlong_buffer.* is set but reward.overlong_buffer.enable=False")
    if cfg.reward.model.path is None and cfg.reward.model != RewardModelConfig():
        out.append("reward.model.* is set but reward.model.path is None")
    if not cfg.actor.use_kl_loss and (cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) != (
        ActorConfig.kl_loss_coef,
        ActorConfig.kl_loss_type,
    ):
        out.append("actor.kl_loss_coef / kl_loss_type are set but actor.use_kl_loss=False")
    out += _ignored_policy_loss_settings(cfg.actor)
    est = alg.adv_estimator.name
    if alg.adv_estimator.uses_reward_components and alg.use_kl_in_reward:
        out.append(
            f"algorithm.use_kl_in_reward does not reach {est}, which reads reward_components_BK, not the token "
            "rewards (use actor.use_kl_loss)"
        )
    if alg.adv_estimator.uses_reward_components and cfg.reward.overlong_buffer.enable:
        out.append(
            f"reward.overlong_buffer does not reach {est}, which reads reward_components_BK, not the shaped score"
        )
    rc = alg.rollout_correction
    if rc.mode in ("off", "mis") and rc.tis_threshold != RolloutCorrectionConfig.tis_threshold:
        out.append(f"algorithm.rollout_correction.tis_threshold is set but mode={rc.mode!r} does not truncate")
    if rc.mode in ("off", "tis") and (rc.mis_lower, rc.mis_upper) != (None, None):
        out.append(f"algorithm.rollout_correction.mis_lower / mis_upper are set but mode={rc.mode!r} rejects nothing")
    ag = cfg.rollout.agent
    if not ag.enabled and ag != AgentConfig():
        out.append(
            "rollout.agent.* is set but rollout.agent has no tools, tool_config_path, interaction or "
            "interaction_config_path"
        )
    if not cfg.teacher.enabled and cfg.teacher != TeacherConfig():
        out.append("teacher.* is set but teacher.model_path is None")
    if not ag.enabled and cfg.reward.agent_weight != RewardConfig.agent_weight:
        out.append("reward.agent_weight is set but rollout.agent is off")
    return out


def _ignored_policy_loss_settings(actor: ActorConfig) -> list[str]:
    loss = actor.policy_loss
    if loss.per_sequence and actor.loss_agg_mode != "seq-mean-token-mean":
        return [
            f"actor.loss_agg_mode={actor.loss_agg_mode!r} does not apply to the {loss.name} policy loss, which "
            f"aggregates seq-mean-token-mean as verl does (it still applies to the KL and entropy terms)"
        ]
    return []
