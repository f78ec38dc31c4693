"""Typed configuration: the single source of truth for every option.

A run is a Python file that defines ``config = Config(...)`` (or a function ``config()`` returning one);
``rlspmd.train`` loads it and lets ``tyro`` apply command-line overrides such as
``--actor.optim.lr 1e-6``. The docstring under each field is what ``--help`` shows.

Sections are handed to the code that reads them (``RolloutConfig`` to the rollout engine, ``OptimConfig`` to
the optimiser builder, ...); nothing receives the whole tree except the trainer that wires the roles.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


@dataclass
class ModelConfig:
    path: str = "models/tiny"
    """Local Hugging Face model directory (config.json, *.safetensors, tokenizer files)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; defaults to ``path``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Storage dtype of the (master) parameters. Keep float32 for training; compute dtype is set by FSDP mixed precision."""
    attn_implementation: str = "sdpa"
    """Transformers attention implementation for training forwards (``sdpa``, ``eager``, ``flash_attention_2``)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (activation checkpointing)."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimiser steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warmup; cosine/linear decay to ``min_lr_ratio * lr`` at ``total_optim_steps``."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of ``lr`` for decaying schedules."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables clipping)."""


@dataclass
class FSDPConfig:
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of unsharded parameters. ``auto``: bfloat16 on CUDA, float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduce-scatter."""
    reshard_after_forward: bool = True
    """Free unsharded parameters after each layer's forward (ZeRO-3). False keeps them until backward (ZeRO-2-like)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU (FSDP2 CPUOffloadPolicy)."""


@dataclass
class ActorConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Policy optimiser."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of the policy."""
    ppo_epochs: int = 1
    """Passes over each step's rollout data."""
    mini_batch_size: int = 16
    """Prompts per optimiser step (global, all DP ranks); each prompt contributes ``rollout.n`` samples."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank (gradient accumulation unit)."""
    logprob_micro_batch_size: int = 16
    """Sequences per no-grad log-prob forward on one rank."""
    policy_loss: str = "ppo_clip"
    """Policy loss (see ``rlspmd.algorithms.POLICY_LOSSES``)."""
    clip_ratio_low: float = 0.2
    """PPO ratio lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO ratio upper clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher raises this)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound for negative advantages (None disables dual clip)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation (see ``rlspmd.algorithms.AGG_MODES``); normalised over the global mini-batch."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy)."""
    use_kl_loss: bool = True
    """Add a KL(policy || reference) term to the loss (GRPO). Needs the reference model."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss term."""
    kl_loss_type: str = "k3"
    """KL estimator for the loss term: k1, abs, k2 (mse), k3 (low_var_kl), or a straight-through '+' variant."""


@dataclass
class RefConfig:
    model_path: str | None = None
    """Reference model directory; defaults to ``actor.model.path``."""
    logprob_micro_batch_size: int = 16
    """Sequences per reference forward on one rank."""


@dataclass
class VllmConfig:
    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU's memory vLLM may take (weights + KV cache + activations), checked against free memory
    when the engine is built: colocated with training, leave room for the actor."""
    kv_cache_memory_bytes: int | None = None
    """Pin the KV cache size per GPU in bytes instead of deriving it from ``gpu_memory_utilization``."""
    max_model_len: int | None = None
    """Longest prompt + response; None = ``data.max_prompt_length + rollout.max_response_length``."""
    max_num_seqs: int = 256
    """Most sequences vLLM schedules at once."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decode, faster start, less memory)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (the n samples of a prompt). Reset after every weight load."""
    sleep_level: Literal[1, 2] = 2
    """Colocated only: 2 discards weights and KV cache between generations (weights re-streamed before the next
    one); 1 keeps a CPU copy of the weights (host memory = model size / TP per rank)."""


@dataclass
class RolloutConfig:
    engine: Literal["native", "vllm"] = "native"
    """Generation engine. ``native`` is torch-only (CPU and GPU); ``vllm`` needs the vllm extra and CUDA."""
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
    max_batch_size: int = 256
    """Most sequences the native engine decodes at once on one rank."""
    val_temperature: float = 0.0
    """Sampling temperature for validation (0 = greedy)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the rollout engine's weights. ``auto``: the actor's FSDP compute dtype (``actor.fsdp.param_dtype``).
    The weight stream casts shards to it before gathering. The colocated native engine reads the actor's gathered
    weights in place when it equals the compute dtype, and keeps its own copy otherwise."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """Settings of the ``vllm`` engine (ignored by ``native``)."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/arithmetic/train.parquet"])
    """Training prompt files (parquet or jsonl, verl schema)."""
    val_files: list[str] = field(default_factory=lambda: ["data/arithmetic/test.parquet"])
    """Validation prompt files (parquet or jsonl, verl schema)."""
    prompt_key: str = "prompt"
    """Column holding the chat messages (a list of {role, content})."""
    max_prompt_length: int = 128
    """Prompts whose templated token count exceeds this are dropped (or rejected, see ``overlong_prompts``)."""
    overlong_prompts: Literal["drop", "error"] = "drop"
    """What to do with prompts longer than ``max_prompt_length``: drop with a count in the log, or fail naming the row."""
    train_batch_size: int = 32
    """Prompts per RL step (global, all DP ranks)."""
    val_batch_size: int = 256
    """Prompts per validation generation round (global)."""
    max_val_samples: int | None = None
    """Use only the first N validation prompts (None = all)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (seeded by ``trainer.seed``)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator (see ``rlspmd.algorithms.ADVANTAGE_ESTIMATORS``)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False gives Dr.GRPO)."""
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""


@dataclass
class RewardConfig:
    function: str | None = None
    """User reward function ``path/to/file.py:fn`` or ``package.module:fn`` with signature
    ``fn(response: str, ground_truth: str, extra_info: dict, data_source: str) -> float``.
    None: rule rewards chosen by each sample's ``data_source``."""


@dataclass
class MeshConfig:
    actor_ranks: str = "all"
    """Global ranks hosting the actor: ``all``, ``0-3`` or ``0,1,2``. Colocated (everything on ``all``) is the default.
    Must include rank 0 (it reads the data and logs)."""
    rollout_ranks: str = "all"
    """Global ranks hosting the rollout engine: the actor's ranks (colocated, the hybrid engine) or ranks disjoint
    from them (split placement: prompts, samples and weights move between the two meshes with collectives)."""
    ref_ranks: str = "actor"
    """Global ranks hosting the reference model; ``actor`` = the actor's ranks (the only placement the RL trainer runs)."""
    critic_ranks: str = "actor"
    """Global ranks hosting the critic; ``actor`` = the actor's ranks."""
    reward_ranks: str = "actor"
    """Global ranks hosting the reward model; ``actor`` = the actor's ranks."""
    rollout_tp: int = 1
    """Tensor-parallel degree of the rollout engine (consecutive ranks form a TP group)."""


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto picks NCCL when CUDA is available, Gloo otherwise."""
    timeout_s: float = 600.0
    """Collective timeout: a rank that waits longer than this for a dead peer fails instead of hanging."""


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
    """Metric sinks: console, jsonl, tensorboard."""
    seed: int = 0
    """Base seed: data order, sampling RNG (offset per rank), model init of new heads."""
    deterministic: bool = False
    """Deterministic algorithms (and cuDNN/cuBLAS settings) so that a repeated run, or a run stopped and resumed
    from a checkpoint, is bit-identical. Slower on GPU."""
    nan_policy: Literal["skip", "stop"] = "skip"
    """A non-finite loss or gradient norm: ``skip`` drops that optimiser update (counted in ``*/skipped_updates``
    and ``trainer/skipped_updates_total``); ``stop`` ends the run with an error naming the step."""
    stop_at_step: int = 0
    """End this job after this step with a checkpoint, while the LR schedule still spans ``total_steps``
    (continue with ``--resume auto``). For chains of walltime-limited jobs, like Megatron's ``--exit-interval``.
    0 runs to ``total_steps``."""


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
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions."""
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
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    module_name = f"_rlspmd_config_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses defined in the file need their module registered
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a typo in the file (e.g. an unknown field) must name the file
        raise ValueError(f"config file {path} failed to load: {type(e).__name__}: {e}") from e
    if not hasattr(module, "config"):
        raise ValueError(f"config file {path} must define `config = {expected_type.__name__}(...)` or a function `config()`")
    cfg = module.config
    if callable(cfg) and not isinstance(cfg, expected_type):
        cfg = cfg()
    if not isinstance(cfg, expected_type):
        raise ValueError(f"config file {path}: `config` is a {type(cfg).__name__}, expected {expected_type.__name__}")
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


@dataclass
class SFTDataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/arithmetic/sft.parquet"])
    """SFT files (parquet/jsonl): the verl prompt schema plus a response column."""
    prompt_key: str = "prompt"
    """Column with the chat messages."""
    response_key: str = "response"
    """Column with the target assistant response (plain text)."""
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
    output_dir: str = "outputs/sft"
    """Metrics go here; the fine-tuned Hugging Face model is written to ``output_dir/hf``."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console, jsonl, tensorboard."""
    log_every: int = 10
    """Log the loss every N steps."""
    seed: int = 0
    """Seed for data order."""
    dist: DistConfig = field(default_factory=DistConfig)
    """torch.distributed settings."""
