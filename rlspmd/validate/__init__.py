"""One pass over the configuration, on every rank, before anything heavy loads.

Everything knowable from the config alone is checked here, right after parsing: sizes that must be positive,
batch sizes that must divide (by mini-batches, by DP ranks), names that must be known (losses, estimators, loggers,
``Literal`` fields set from a config file), role placement, and the files and functions that must exist (model and
tokenizer directories, with every safetensors header; data files; the reward function, found without running the
user's code). Every problem is collected and reported at once, one line each, naming the field and its value.

Every rank runs the same checks on the same config, so every rank fails (or passes) together, before any
collective. Checks that need the data or the model (prompt lengths, chat template, data sources) stay where the data
and the model are read.

The package, by concern: ``problems.py`` (the collector's ``Problems``, ``ConfigError`` and the type check),
``sections.py`` (each section's checks), ``files.py`` (the files and functions a run reads), ``ignored.py``
(settings that do nothing); the collectors are here.
"""

from __future__ import annotations


from rlspmd.config import (
    AgentConfig,
    Config,
    SFTConfig,
)
from rlspmd.roles.moe import config_problems as moe_problems
from rlspmd.validate.files import check_context, check_data_files, check_files_exist, check_model_files
from rlspmd.validate.problems import ConfigError, Problems, check_types
from rlspmd.validate.sections import (
    check_actor,
    check_actor_sp,
    check_actor_tp,
    check_agent,
    check_algorithm,
    check_bypass_mode,
    check_checkpoint,
    check_critic,
    check_data,
    check_dist,
    check_gdpo,
    check_loggers,
    check_optim,
    check_packing,
    check_placement,
    check_reward,
    check_rollout,
    check_staleness,
    check_teacher,
    component_problems,
)
from rlspmd.validate.files import check_function_spec, model_context
from rlspmd.validate.ignored import ignored_settings
from rlspmd.validate.sections import LOGGERS

__all__ = [
    "LOGGERS",
    "ConfigError",
    "check_config",
    "check_function_spec",
    "check_sft_config",
    "config_problems",
    "ignored_settings",
    "model_context",
    "sft_config_problems",
]


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
    check_types(p, cfg, "")
    if p.lines:  # the checks below compare and divide: they need values of the right types
        return p.lines
    dp, split = check_placement(p, cfg.mesh, world_size=world_size, engine=cfg.rollout.engine)
    d, r = cfg.data, cfg.rollout
    with_critic = cfg.algorithm.adv_estimator.uses_critic
    check_data(p, d)
    check_rollout(p, r)
    if r.agent.enabled:
        check_agent(p, r.agent, ignore_eos=r.ignore_eos, check_files=check_files)
    check_actor(p, cfg.actor, train_batch_size=d.train_batch_size, n=r.n, dp=dp)
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
        check_critic(p, cfg.critic, train_batch_size=d.train_batch_size, n=r.n, dp=dp)
    if cfg.mesh.actor_tp > 1:
        check_actor_tp(p, cfg, with_critic=with_critic, check_files=check_files)
    if cfg.mesh.actor_sp > 1:
        check_actor_sp(p, cfg, with_critic=with_critic, check_files=check_files)
    for name, value, why in moe_problems(cfg, check_files=check_files):  # actor.moe, mesh.actor_ep
        p.add(name, value, why)
    check_algorithm(p, cfg.algorithm, train_batch_size=d.train_batch_size, n=r.n, dp=dp)
    check_reward(
        p,
        cfg.reward,
        max_response_length=r.max_response_length,
        agent=r.agent.enabled,
        needed=cfg.algorithm.adv_estimator.uses_reward,
    )
    check_teacher(p, cfg, split=split)
    check_gdpo(p, cfg.algorithm, cfg.reward, agent=r.agent.enabled)
    check_dist(p, cfg.dist)
    t = cfg.trainer
    p.at_least("trainer.total_steps", t.total_steps, 1)
    p.at_least("trainer.val_every", t.val_every, 0)
    if not 0 <= t.stop_at_step <= t.total_steps:
        p.add("trainer.stop_at_step", t.stop_at_step, f"must be in [0, trainer.total_steps={t.total_steps}]")
    check_loggers(p, "trainer.loggers", t.loggers, t.tracking, tracking="trainer.tracking")
    p.at_least("trainer.samples.num_train", t.samples.num_train, 0)
    p.at_least("trainer.samples.num_val", t.samples.num_val, 0)
    for i, stage in enumerate(t.stages):
        component_problems(p, f"trainer.stages[{i}]", stage)
    check_staleness(p, t.max_staleness, split=split, alg=cfg.algorithm)
    check_bypass_mode(p, cfg, split=split)
    check_checkpoint(p, cfg.checkpoint, check_files=check_files)
    if check_files:
        check_files_exist(p, cfg, with_critic=with_critic)
        check_context(p, cfg, with_critic=with_critic)
    return p.lines


def sft_config_problems(cfg: SFTConfig, *, world_size: int, check_files: bool = True) -> list[str]:
    p = Problems()
    check_types(p, cfg, "")
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
    check_optim(p, "optim", cfg.optim)
    check_packing(p, "model", cfg.model.attn_implementation, cfg.model.packing)
    check_dist(p, cfg.dist)
    check_loggers(p, "loggers", cfg.loggers, cfg.tracking, tracking="tracking")
    check_checkpoint(p, cfg.checkpoint, check_files=check_files)
    if d.tools:  # demonstrations rendered with tool schemas: the tools must build as the RL run builds them
        from rlspmd.agent import load_tools

        p.file_check(load_tools, AgentConfig(tools=d.tools), field_name="data.tools")
    if check_files:
        check_model_files(p, "model", cfg.model.path, tokenizer=cfg.model.tokenizer_path or cfg.model.path)
        check_data_files(p, "data.train_files", d.train_files)
    return p.lines
