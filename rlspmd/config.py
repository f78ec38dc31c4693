"""Typed configuration: the top-level sections that compose a run's components.

A run is a Python file that defines ``config = Config(...)`` (or a function ``config()`` returning one);
``rlspmd.train`` loads it and lets ``tyro`` apply command-line overrides such as
``--actor.optim.lr 1e-6``. The docstring under each field is what ``--help`` shows.

Each component's own config lives beside its code and is re-exported here for config files
(``from rlspmd.config import *``): policy losses (``rlspmd/algorithms/losses/``), advantage estimators
(``algorithms/estimators.py``), KL controllers (``algorithms/kl.py``), training engines (``engines/fsdp``,
``engines/megatron/config.py``), rollout engines (``rollout/native.py``, ``rollout/vllm.py``), and the sections
that lower layers read (``ModelConfig`` in ``models/loader.py``, ``OptimConfig`` in ``engines/optim.py``, ``MeshConfig``
in ``distributed/mesh.py``, ...). A field that holds a component picked by name is annotated with its kind's
``Registry.choice()`` (``rlspmd/components.py``): every registered member is a subcommand on the command line, a
user's own class from their own file included.

Sections are handed to the code that reads them (``RolloutConfig`` to the rollout role, ``OptimConfig`` to the
optimiser builder, ...); nothing receives the whole tree except the builder that wires the roles.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import tyro

from rlspmd.agent.config import AgentConfig, CodeRunnerConfig
from rlspmd.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    GAE,
    GDPO,
    GRPO,
    OPO,
    RLOO,
    GPGAdvantage,
    GRPOPassK,
    MultiTurnOptimalTokenBaseline,
    NoAdvantage,
    OptimalTokenBaseline,
    ReinforcePP,
    ReinforcePPBaseline,
    ReMax,
)
from rlspmd.algorithms.distill import GKD, ReverseKL, TeacherConfig
from rlspmd.algorithms.kl import KL_CONTROLS, AdaptiveKL, FixedKL
from rlspmd.algorithms.losses import (
    CISPO,
    DPPOKL,
    DPPOTV,
    DRO,
    GMPO,
    GPG,
    GSPO,
    POLICY_LOSSES,
    SAPO,
    ClipCov,
    KLCov,
    PPOClip,
)
from rlspmd.algorithms.rollout_correction import RolloutCorrectionConfig
from rlspmd.components import describe, picked_fields
from rlspmd.distributed.mesh import MeshConfig
from rlspmd.distributed.runtime import DistConfig
from rlspmd.engines.base import TRAINING_ENGINES
from rlspmd.engines.fsdp import FSDPConfig
from rlspmd.engines.megatron.config import MegatronConfig
from rlspmd.engines.optim import OptimConfig
from rlspmd.models.loader import ModelConfig
from rlspmd.models.lora import LoraConfig
from rlspmd.models.moe import MoEConfig
from rlspmd.rewards.config import OverlongBufferConfig, RewardConfig, RewardModelConfig
from rlspmd.rollout.base import ROLLOUT_ENGINES
from rlspmd.rollout.native import NativeConfig
from rlspmd.rollout.vllm import VllmConfig
from rlspmd.stages import StepStage
from rlspmd.trackers import TrackerConfig

__all__ = [  # the sections below, and the components and sections a config file composes
    "ActorConfig", "AdaptiveKL", "AgentConfig", "AlgorithmConfig", "CheckpointConfig", "CISPO", "ClipCov",
    "CodeRunnerConfig", "Config", "CriticConfig", "DataConfig", "DistConfig", "DPPOKL", "DPPOTV", "DRO",
    "FilterGroupsConfig", "FixedKL", "FSDPConfig", "GAE", "GDPO", "GKD", "GMPO", "GPG", "GPGAdvantage", "GRPO",
    "GRPOPassK", "GSPO", "KLCov", "load_config_file", "LoraConfig", "MegatronConfig", "MeshConfig", "ModelConfig",
    "MoEConfig", "MultiTurnOptimalTokenBaseline", "NativeConfig", "NoAdvantage", "OPO", "OptimalTokenBaseline",
    "OptimConfig", "OverlongBufferConfig", "PPOClip", "RefConfig", "ReinforcePP", "ReinforcePPBaseline", "ReMax",
    "ReverseKL", "RewardConfig", "RewardModelConfig", "RLOO", "RolloutConfig", "RolloutCorrectionConfig",
    "SampleLogConfig", "SAPO", "SFTConfig", "SFTDataConfig", "StepStage", "TeacherConfig", "to_dict", "TrackerConfig",
    "TrainedRoleConfig", "TrainerConfig", "VllmConfig",
]  # fmt: skip

Engine = TRAINING_ENGINES.choice()
"""``actor.engine`` / ``critic.engine``: a training engine (``actor.engine:megatron --actor.engine.tp 2``)."""
PolicyLossChoice = POLICY_LOSSES.choice()
"""``actor.policy_loss``: a policy loss (``actor.policy-loss:gspo --actor.policy-loss.clip-ratio-low 3e-4``)."""
EstimatorChoice = ADVANTAGE_ESTIMATORS.choice()
"""``algorithm.adv_estimator``: an advantage estimator (``algorithm.adv-estimator:gae``)."""
KLControlChoice = KL_CONTROLS.choice()
"""``algorithm.kl_ctrl``: a KL controller (``algorithm.kl-ctrl:adaptive``)."""
RolloutEngine = ROLLOUT_ENGINES.choice()
"""``rollout.engine``: a rollout engine (``rollout.engine:vllm --rollout.engine.max-num-seqs 64``)."""


@dataclass
class TrainedRoleConfig:
    """What the actor and the critic share: the engine they train on, how a step's batch splits into optimiser steps
    and micro-batches (``rlspmd.trainer.build_models.role_plan`` reads exactly these),
    and how their loss is aggregated."""

    engine: Engine = field(default_factory=FSDPConfig)
    """Training engine with its options: ``FSDPConfig()`` (FSDP2, every feature; the default) or
    ``MegatronConfig(tp=..., pp=...)`` (megatron-core tensor and pipeline parallelism; FSDP-only features:
    docs/megatron.md). The reference runs on the actor's. On the command line: ``actor.engine:megatron
    --actor.engine.tp 2``."""
    ppo_epochs: int = 1
    """Passes over each step's rollout data."""
    mini_batch_size: int = 16
    """Prompts per optimiser step of this role (global, all DP ranks); each prompt contributes ``rollout.n`` samples."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank (gradient accumulation unit)."""
    max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the update: micro-batches hold at most this many valid tokens (prompt + response) per
    rank instead of ``micro_batch_size`` sequences (a longer sequence gets one of its own). All DP ranks run the same
    number of micro-batches. Mini-batches and loss normalisation are unchanged, so is the gradient. None: off."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the role's loss (see ``rlspmd.algorithms.AGG_MODES``), normalised over the global mini-batch."""


@dataclass
class ActorConfig(TrainedRoleConfig):
    """The policy being trained (its engine and model also serve the reference)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Policy optimiser."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (``lora.rank`` > 0; FSDP engine)."""
    logprob_micro_batch_size: int = 16
    """Sequences per no-grad log-prob forward on one rank."""
    reuse_update_logprobs: bool = True
    """When a step makes exactly one optimiser update (``ppo_epochs`` 1 and ``mini_batch_size`` = the train batch) and
    nothing needs the old log-probs before the update (no KL in the reward), the behaviour policy *is* the policy
    being updated: take the old log-probs from the update's own forward (detached) instead of a separate no-grad
    pass. Same loss and gradient, one forward fewer per step (TRL does the same). False: always recompute."""
    logprob_max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the old-log-prob forward (no grad, so it can be larger than the update's). None: off."""
    policy_loss: PolicyLossChoice = field(default_factory=PPOClip)
    """Policy loss and its options: ``PPOClip()`` (the default), ``GSPO()``, ``CISPO()``, ``SAPO()``, ``GPG()``,
    ``GMPO()``, ``ClipCov()``, ``KLCov()``, ``DPPOTV()``, ``DPPOKL()``, ``DRO()``. On the command line:
    ``actor.policy-loss:gspo`` picks one, then ``--actor.policy-loss.<option>``. gspo, sapo and gmpo aggregate their
    loss ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (as verl does); ``loss_agg_mode`` still applies to the
    KL and entropy terms."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy)."""
    use_kl_loss: bool = True
    """Add a KL(policy || reference) term to the loss (GRPO). Needs the reference model."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss term."""
    kl_loss_type: str = "k3"
    """KL estimator for the loss term: k1 (kl), abs, k2 (mse), k3 (low_var_kl), or any of them with '+' (the value
    of that estimator with k2's gradient, e.g. ``k3+``, ``low_var_kl+``, ``abs+``): verl's names."""
    freeze_vision_tower: bool = False
    """A vision-language model (docs/vision.md): train the language model only; the vision tower and its merger keep
    their weights (no gradients, no optimiser state)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts options: the load-balancing loss, routing replay (ignored for a dense model)."""


@dataclass
class RefConfig:
    model_path: str | None = None
    """Reference model directory; defaults to ``actor.model.path``."""
    logprob_micro_batch_size: int = 16
    """Sequences per reference forward on one rank."""
    logprob_max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the reference forward: at most this many valid tokens per micro-batch. None: off."""
    offload: bool = False
    """Keep the frozen reference's sharded parameters in host memory between uses: moved to the GPU before its
    forward and back after (frees its share of GPU memory for rollout and training). Does nothing on CPU (warns)."""


@dataclass
class CriticConfig(TrainedRoleConfig):
    """The value model of PPO (``algorithm.adv_estimator=GAE()``); ignored by critic-free estimators. Its engine, batch
    sizes and loss aggregation: ``TrainedRoleConfig``."""

    model_path: str | None = None
    """Initialisation directory; None = ``actor.model.path``. A causal LM or base model gets a fresh scalar
    value head (seeded by ``trainer.seed``); a directory whose weights hold ``value_head.*`` or a one-label
    ``score.*`` head (a reward model) starts from that head."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimiser."""
    values_micro_batch_size: int = 16
    """Sequences per no-grad value forward on one rank."""
    values_max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the no-grad value forward. None: off."""
    cliprange_value: float | None = 0.5
    """Value clipping: the new value may move at most this far from the rollout's value (None disables)."""
    warmup_steps: int = 0
    """RL steps at the start that update only the critic; actor updates start after them."""


@dataclass
class RolloutConfig:
    engine: RolloutEngine = field(default_factory=NativeConfig)
    """Generation engine with its options: ``NativeConfig()`` (torch-only, CPU and GPU; the default) or
    ``VllmConfig()`` (in-process vLLM: the vllm extra on CUDA, vLLM's CPU build elsewhere). On the command line:
    ``rollout.engine:vllm --rollout.engine.max-num-seqs 64``."""
    n: int = 4
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 disables)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_response_length: int = 64
    """Maximum generated tokens per sample; longer responses are truncated (and counted in the clip ratio)."""
    ignore_eos: bool = False
    """Training rollouts never sample EOS, so every response has exactly ``max_response_length`` tokens (a fixed
    workload for benchmarks, like vLLM's ``ignore_eos`` + ``min_tokens``). Validation is unaffected."""
    val_temperature: float = 0.0
    """Sampling temperature for validation (0 = greedy)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the rollout engine's weights. ``auto``: the actor's compute dtype (``actor.engine.param_dtype``).
    The weight stream casts shards to it before gathering. The colocated native engine reads the actor's gathered
    weights in place when it equals the compute dtype, and keeps its own copy otherwise."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts with tool calls and interactions (off unless ``agent`` names a tool or an interaction)."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/arithmetic/train.parquet"])
    """Training prompt files (parquet or jsonl, verl schema)."""
    val_files: list[str] = field(default_factory=lambda: ["data/arithmetic/test.parquet"])
    """Validation prompt files (parquet or jsonl, verl schema)."""
    prompt_key: str = "prompt"
    """Column holding the chat messages (a list of {role, content})."""
    image_key: str = "images"
    """Column holding a row's images, one per ``<image>`` in its prompt (verl's multimodal rows; docs/vision.md)."""
    max_prompt_length: int = 128
    """Prompts whose templated token count exceeds this are dropped (or rejected, see ``overlong_prompts``)."""
    overlong_prompts: Literal["drop", "error"] = "drop"
    """What to do with prompts longer than ``max_prompt_length``: drop with a count in the log, or fail naming the
    row."""
    empty_prompts: Literal["error", "drop"] = "error"
    """What to do with a row whose prompt has no user message with text (empty or whitespace content): fail naming
    the file and row, or drop it with a count in the log."""
    train_batch_size: int = 32
    """Prompts per RL step (global, all DP ranks)."""
    val_batch_size: int = 256
    """Prompts per validation generation round (global)."""
    max_val_samples: int | None = None
    """Use only the first N validation prompts (None = all)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded by ``trainer.seed``)."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose scores are all equal and generate more rounds until
    ``data.train_batch_size`` groups with signal are collected (or ``max_rounds`` is reached)."""
    metric: Literal["task_score", "score"] = "task_score"
    """What must vary within a group to keep it: ``task_score`` (the rule/function score, i.e. accuracy) or
    ``score`` (the final reward after reward-model mixing and overlong shaping)."""
    max_rounds: int = 4
    """Most generation rounds per step. If the batch is still short after them, it is topped up with dropped
    groups from the last round (zero advantage for group estimators), so every step trains on a full batch."""
    gen_batch_size: int | None = None
    """Prompts drawn per generation round (global); None = ``data.train_batch_size``. Must be >= it."""


@dataclass
class AlgorithmConfig:
    adv_estimator: EstimatorChoice = field(default_factory=GRPO)
    """Advantage estimator and its options: ``GAE()`` (PPO, builds the critic), ``GRPO()`` (the default),
    ``GRPOPassK()``, ``RLOO()``, ``ReinforcePP()``, ``ReinforcePPBaseline()``, ``ReMax()`` (a greedy baseline
    rollout), ``OPO()``, ``GPGAdvantage()``, ``GDPO()`` (several reward components), ``OptimalTokenBaseline()``,
    ``MultiTurnOptimalTokenBaseline()``, ``NoAdvantage()`` (none: pure distillation from a ``teacher``). On the
    command line: ``algorithm.adv-estimator:gae`` picks one, then ``--algorithm.adv-estimator.<option>``."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_ctrl.kl_coef * KL(policy || reference)`` from every response token's reward (InstructGPT-style
    PPO, REINFORCE++). Needs the reference model. Independent of ``actor.use_kl_loss``."""
    kl_penalty: str = "k1"
    """KL estimator for the in-reward penalty: k1 (kl), abs, k2 (mse), k3 (low_var_kl); a '+' form gives the same
    values (verl's names are accepted)."""
    kl_ctrl: KLControlChoice = field(default_factory=FixedKL)
    """Coefficient of the in-reward KL penalty: ``FixedKL()`` (the default) or ``AdaptiveKL()``. On the command line:
    ``algorithm.kl-ctrl:adaptive`` picks one, then ``--algorithm.kl-ctrl.<option>``."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance-sampling correction of the policy loss for the rollout engine's numerics, and its metrics."""


@dataclass
class SampleLogConfig:
    """The sample log: a few conversations per step, readable from the run's output directory
    (``<trainer.output_dir>/samples/{train,val}.jsonl``, TensorBoard's text tab, ``python -m rlspmd.samples``)."""

    enable: bool = True
    """Write the sample log (rank 0; the chosen rows reach it with one gather per step)."""
    num_train: int = 4
    """Training samples logged per step, all DP ranks together: the first rows of each rank's share of the trained batch
    (rank r logs ``even_split(num_train, dp)[r]``). 0: none."""
    num_val: int = 8
    """Validation samples logged per validation: the first ``num_val`` validation prompts, the same ones every time, so
    their answers can be compared across steps. 0: none."""


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """RL steps to run."""
    val_every: int = 10
    """Validate every N steps (0 disables periodic validation)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    output_dir: str = "outputs/run"
    """Where metrics (metrics.jsonl, TensorBoard events) and checkpoints go."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console, jsonl, tensorboard, and the experiment trackers wandb, mlflow, trackio (``tracking``)."""
    tracking: TrackerConfig = field(default_factory=TrackerConfig)
    """The experiment trackers' project, run name, offline mode and servers (``rlspmd/trackers.py``)."""
    seed: int = 0
    """Base seed: data order, sampling RNG (offset per rank), model init of new heads."""
    deterministic: bool = False
    """Deterministic algorithms (and cuDNN/cuBLAS settings) so that a repeated run, or a run stopped and resumed
    from a checkpoint, is bit-identical. Slower on GPU."""
    balance_batch: bool = True
    """Before the updates, move samples between DP ranks (within each mini-batch) so every rank trains on about the
    same number of tokens. Same samples per optimiser step, so the same gradient; logs ``balance/token_imbalance_*``."""
    nan_policy: Literal["skip", "stop"] = "skip"
    """A non-finite loss or gradient norm: ``skip`` drops that optimiser update (counted in ``*/skipped_updates``
    and ``trainer/skipped_updates_total``); ``stop`` ends the run with an error naming the step."""
    stop_at_step: int = 0
    """End this job after this step with a checkpoint, while the LR schedule still spans ``total_steps``
    (continue with ``--resume auto``). For chains of walltime-limited jobs, like Megatron's ``--exit-interval``.
    0 runs to ``total_steps``."""
    max_staleness: int = 0
    """Asynchronous RL, split placement only (``mesh.rollout_ranks`` apart from the actor's): the rollout ranks
    generate the batch of step t + k while the actor ranks train on step t (k = ``max_staleness``), so a batch is
    trained on with weights up to k updates newer than the ones that generated it. Every sample carries its weight
    version (``weight_version_B``); ``rollout/staleness/*`` logs the distribution. 0: the synchronous loop. With k > 0
    ``algorithm.rollout_correction.mode=auto`` switches the correction on. Not with dynamic sampling
    (``algorithm.filter_groups``) or ReMax, whose extra generation rounds depend on the batch being trained."""
    samples: SampleLogConfig = field(default_factory=SampleLogConfig)
    """The sample log (``samples/train.jsonl``, ``samples/val.jsonl``)."""
    stages: Annotated[list[StepStage], tyro.conf.Suppress] = field(default_factory=list)
    """A user's own stages of the step (``StepStage`` components, ``rlspmd/stages.py``), each run at its point of every
    step on every actor rank, in this order; set from a Python config (docs/extending.md)."""
    print_summary_json: bool = False
    """Print the run summary as one JSON line at the very end (``sec_per_step``: median step time after the first
    step; ``gen_tokens_per_sec``; the step-time breakdown; the machine). The benchmark configs turn it on."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint root; defaults to ``<trainer.output_dir>/checkpoints``. Holds ``step_XXXXXXXX/`` directories
    (DCP shards, ``meta.json``, the model config and tokenizer) and a ``latest`` pointer. Must be shared by all
    nodes."""
    save_every: int = 0
    """Save every N steps (0: only at the end, see ``save_final``, and on SIGTERM/SIGUSR1)."""
    save_final: bool = True
    """Save after the last step."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints, delete older ones (0 keeps all)."""
    save_hf: bool = False
    """Also write the actor as a Hugging Face directory (``step_XXXXXXXX/hf``: safetensors, config, tokenizer)."""
    resume: str = "auto"
    """``auto``: continue from the newest complete checkpoint in ``dir`` if there is one, else start fresh;
    ``none``: start fresh (refuses a ``dir`` that already holds checkpoints); or a path to a checkpoint
    (``.../step_XXXXXXXX``) or a checkpoint root (its newest). ``--resume`` is a shorthand."""


@dataclass
class Config:
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy being trained."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Frozen reference policy (KL anchor)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """Frozen teacher of on-policy distillation and its signal (``rlspmd/algorithms/distill.py``); off by default."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (PPO with GAE only)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation, KL in the reward, dynamic sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions, reward model, reward shaping."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Role placement over ranks."""
    dist: DistConfig = field(default_factory=DistConfig)
    """torch.distributed settings."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop: steps, validation, logging."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving, resuming, Hugging Face export at save time."""


def load_config_file(path: str | Path, expected_type: type = Config):
    """Import a Python config file and return its config object.

    The file defines ``config = <expected_type>(...)`` or a zero-argument function ``config()`` returning one.
    ``file.py:name`` selects another attribute of the file instead of ``config`` (an instance or a zero-argument
    function), e.g. ``configs/grpo.py:cpu`` for the CPU variant that the algorithm configs define next to the
    GPU-scale ``config``. The file's directory goes on ``sys.path``, as a script's does, so it can import a user's
    components from the files next to it (``from my_losses import MyLoss``).
    """
    path, name = _split_selector(str(path))
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    folder = str(path.parent.resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = f"_rlspmd_config_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses defined in the file need their module registered
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a typo in the file (e.g. an unknown field) must name the file
        raise ValueError(f"config file {path} failed to load: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        if name != "config":
            known = sorted(
                k
                for k, v in vars(module).items()
                if not k.startswith("_")
                and (
                    isinstance(v, expected_type)
                    or (callable(v) and not isinstance(v, type) and getattr(v, "__module__", None) == module_name)
                )
            )
            raise ValueError(f"config file {path} has no `{name}` (selected by `:{name}`); it defines {known}")
        raise ValueError(
            f"config file {path} must define `config = {expected_type.__name__}(...)` or a function `config()`"
        )
    cfg = getattr(module, name)
    if callable(cfg) and not isinstance(cfg, expected_type):
        cfg = cfg()
    if not isinstance(cfg, expected_type):
        raise ValueError(f"config file {path}: `{name}` is a {type(cfg).__name__}, expected {expected_type.__name__}")
    return cfg


def _split_selector(spec: str) -> tuple[Path, str]:
    """``dir/file.py:name`` -> (Path, name); a plain path selects ``config``."""
    head, sep, name = spec.rpartition(":")
    if sep and head.endswith(".py") and name.isidentifier():
        return Path(head), name
    return Path(spec), "config"


def to_dict(cfg, *, picked: bool = False) -> dict:
    """The config as plain data (the run's ``config.json``, the checkpoint's meta). A component picked by name
    (``picked_fields``) records that name first, so two components with the same options (PPO-clip and CISPO with
    equal clip values) stay told apart, and a user's component its import path (``components.describe``)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        out = describe(cfg) if picked else {}
        chosen = picked_fields(type(cfg))
        for f in dataclasses.fields(cfg):
            out[f.name] = to_dict(getattr(cfg, f.name), picked=f.name in chosen)
        return out
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(to_dict(v) for v in cfg)
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return copy.deepcopy(cfg)


@dataclass
class SFTDataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/arithmetic/sft.parquet"])
    """SFT files (parquet/jsonl): the verl prompt schema plus a response column."""
    prompt_key: str = "prompt"
    """Column with the chat messages."""
    response_key: str = "response"
    """Column with the target assistant response (plain text)."""
    image_key: str = "images"
    """Column with a row's images, one per ``<image>`` in its prompt (a vision-language model; docs/vision.md)."""
    messages_key: str | None = None
    """Column with whole conversations (lists of ``{role, content}`` messages: user, assistant, tool, ...) instead of
    ``prompt_key`` + ``response_key``. The messages before the first assistant turn are the prompt; the loss covers the
    assistant turns only, each its content plus EOS, and the tool/user turns between them are appended as the chat
    template's token deltas, exactly as multi-turn rollouts build them (``rlspmd/agent/chat.py``)."""
    tools: list[str] = field(default_factory=list)
    """Tools whose schemas are rendered into every prompt (the names of ``rollout.agent.tools``), so demonstrations
    are tokenized as the RL run will see them."""
    tool_prompt: Literal["template", "system"] = "template"
    """How the tool schemas reach the prompt, as ``rollout.agent.tool_prompt``: ``system`` for chat templates without
    tool support (SmolLM2's); the exported model's tokenizer then renders tools that way too."""
    max_length: int = 256
    """Prompt + response tokens; longer rows are dropped (counted in the log)."""
    batch_size: int = 64
    """Sequences per optimiser step (global, all DP ranks)."""
    shuffle: bool = True
    """Shuffle each epoch (seeded)."""


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model to fine-tune."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Optimiser."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Training data."""
    micro_batch_size: int = 32
    """Sequences per forward/backward on one rank."""
    total_steps: int = 500
    """Optimiser steps."""
    stop_at_step: int = 0
    """Stop after this step with a checkpoint, before ``total_steps`` (0: run to the end); ``--resume auto``
    continues."""
    output_dir: str = "outputs/sft"
    """Metrics go here; the fine-tuned Hugging Face model is written to ``output_dir/hf``."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console, jsonl, tensorboard, and the experiment trackers wandb, mlflow, trackio (``tracking``)."""
    tracking: TrackerConfig = field(default_factory=TrackerConfig)
    """The experiment trackers' project, run name, offline mode and servers (``rlspmd/trackers.py``)."""
    log_every: int = 10
    """Log the loss every N steps."""
    seed: int = 0
    """Seed for data order."""
    dist: DistConfig = field(default_factory=DistConfig)
    """torch.distributed settings."""
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(save_final=False))
    """Resumable checkpoints under ``output_dir/checkpoints``: the sharded model and optimiser, the LR schedule and the
    data order (``checkpoint.save_every``; on SIGTERM/SIGUSR1 always). ``--resume auto`` (the default) continues from
    the newest one, bit for bit. Off at the end by default (``save_final``): the product is ``output_dir/hf``."""
