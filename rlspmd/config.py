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
    """Recompute each decoder layer's activations in the backward pass (activation checkpointing): less activation
    memory for about one more forward of compute. Gradients are unchanged."""
    packing: bool = True
    """Remove padding: run each micro-batch's valid tokens as one packed sequence with per-sample boundaries
    (flash-attn varlen on CUDA when installed, per-sample SDPA otherwise). Same results as the padded forward, less
    compute. Needs ``attn_implementation`` ``sdpa`` or ``flash_attention_2``."""


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
    max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the update: micro-batches hold at most this many valid tokens (prompt + response) per
    rank instead of ``micro_batch_size`` sequences (a longer sequence gets one of its own). All DP ranks run the same
    number of micro-batches. Mini-batches and loss normalisation are unchanged, so is the gradient. None: off."""
    reuse_update_logprobs: bool = True
    """When a step makes exactly one optimiser update (``ppo_epochs`` 1 and ``mini_batch_size`` = the train batch) and
    nothing needs the old log-probs before the update (no KL in the reward), the behaviour policy *is* the policy
    being updated: take the old log-probs from the update's own forward (detached) instead of a separate no-grad
    pass. Same loss and gradient, one forward fewer per step (TRL does the same). False: always recompute."""
    logprob_max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the old-log-prob forward (no grad, so it can be larger than the update's). None: off."""
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
    sapo_tau_pos: float = 1.0
    """SAPO (``policy_loss=sapo``): gate temperature for tokens with a positive advantage."""
    sapo_tau_neg: float = 1.05
    """SAPO (``policy_loss=sapo``): gate temperature for tokens with a non-positive advantage."""


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
class CriticConfig:
    """The value model of PPO (``algorithm.adv_estimator=gae``); ignored by critic-free estimators."""

    model_path: str | None = None
    """Initialisation directory; None = ``actor.model.path``. A causal LM or base model gets a fresh scalar
    value head (seeded by ``trainer.seed``); a directory whose weights hold ``value_head.*`` or a one-label
    ``score.*`` head (a reward model) starts from that head."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimiser."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding of the critic."""
    ppo_epochs: int = 1
    """Passes over each step's rollout data."""
    mini_batch_size: int = 16
    """Prompts per critic optimiser step (global, all DP ranks)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank."""
    values_micro_batch_size: int = 16
    """Sequences per no-grad value forward on one rank."""
    max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the critic update: at most this many valid tokens per micro-batch (see
    ``actor.max_tokens_per_micro_batch``). None: off."""
    values_max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the no-grad value forward. None: off."""
    cliprange_value: float | None = 0.5
    """Value clipping: the new value may move at most this far from the rollout's value (None disables)."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss (see ``rlspmd.algorithms.AGG_MODES``), over the global mini-batch."""
    warmup_steps: int = 0
    """RL steps at the start that update only the critic; actor updates start after them."""


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
    compile_decode: bool = False
    """Native engine: run the decode step through ``torch.compile`` (Llama-family models). The compiled step has
    static shapes (it attends over the whole preallocated KV cache under a mask, and finished rows are not compacted
    away), so it compiles once per batch-size/length pattern; the first generations pay the compile time. Same
    tokens as the eager step (tested on CPU). On a 2-core CPU it is no faster than eager (measured 1.11 s vs 1.02 s
    per 64 x 128 generation); it is meant for GPUs, where per-kernel launch overhead dominates decoding, and has not
    been measured there. CUDA graphs are not used: the step writes the cache in place."""
    ignore_eos: bool = False
    """Training rollouts never sample EOS, so every response has exactly ``max_response_length`` tokens (a fixed
    workload for benchmarks, like vLLM's ``ignore_eos`` + ``min_tokens``). Validation is unaffected."""
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
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: the coefficient stays ``kl_coef``; ``adaptive``: steered toward ``target_kl`` (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient of the per-token KL penalty in the reward."""
    target_kl: float = 0.1
    """Adaptive: the per-token KL the controller steers toward."""
    horizon: float = 10000.0
    """Adaptive: samples over which a 20% coefficient change is reached (the controller's time constant)."""


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
    adv_estimator: str = "grpo"
    """Advantage estimator (see ``rlspmd.algorithms.ADVANTAGE_ESTIMATORS``): gae (PPO, needs the critic), grpo,
    grpo_passk, rloo, reinforce_pp, reinforce_pp_baseline, remax (greedy baseline rollout), opo, gpg."""
    norm_adv_by_std: bool = True
    """grpo and grpo_passk: divide group-relative advantages by the group std. ``False`` with grpo is Dr.GRPO
    (``--algorithm.no-norm-adv-by-std``). GPG always uses F_norm = 1, its paper's best setting."""
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_ctrl.kl_coef * KL(policy || reference)`` from every response token's reward (InstructGPT-style
    PPO, REINFORCE++). Needs the reference model. Independent of ``actor.use_kl_loss``."""
    kl_penalty: str = "k1"
    """KL estimator for the in-reward penalty: k1, abs, k2 (mse), k3 (low_var_kl)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient of the in-reward KL penalty: fixed or adaptive."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""


@dataclass
class RewardModelConfig:
    path: str | None = None
    """Hugging Face ``*ForSequenceClassification`` directory (one label) that scores prompt + response.
    None: no reward model."""
    tokenizer_path: str | None = None
    """The reward model's tokenizer (and chat template); defaults to ``path``. When it differs from the actor's,
    prompt and response are re-rendered as text with the reward model's own template."""
    weight: float = 1.0
    """Weight of the reward model's score in the reward: ``score = rule_weight * rule + weight * rm``."""
    micro_batch_size: int = 16
    """Sequences per reward-model forward on one rank."""
    max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the reward-model forward: at most this many valid tokens per micro-batch. None: off."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong reward shaping: a linear penalty for responses that run into the last ``len`` tokens before
    ``rollout.max_response_length``."""
    len: int = 16
    """Length of the soft-penalty buffer at the end of the response budget (tokens)."""
    penalty_factor: float = 1.0
    """Penalty at ``rollout.max_response_length`` tokens (it grows linearly from 0 at the buffer's start)."""


@dataclass
class RewardConfig:
    function: str | None = None
    """User reward function ``path/to/file.py:fn`` or ``package.module:fn`` with signature
    ``fn(response: str, ground_truth: str, extra_info: dict, data_source: str) -> float``.
    None: rule rewards chosen by each sample's ``data_source``."""
    rule_weight: float = 1.0
    """Weight of the rule / function score. 0 with a reward model: the reward model alone (rule functions are
    not called, so accuracy metrics read 0)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward model (sequence classifier), combined with the rule score."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong reward shaping (training rewards only; validation reports the unshaped score)."""
    timeout_s: float | None = 60.0
    """Hard limit in seconds on one call of a reward function. With a limit, ``reward.function`` and third-party rule
    checkers (reasoning-gym) run in a pool of worker processes, and a call that takes longer is killed together with
    its worker (which is replaced): this stops calls that ignore signals, e.g. a C-level loop in a math checker. The
    built-in gsm8k/arithmetic rules always run in this process (a bounded regular expression). None: every function
    runs in this process without a limit (a call that never returns stalls the step until ``dist.hang_timeout_s``)."""
    timeout_policy: Literal["zero", "error"] = "zero"
    """A call that runs past ``timeout_s``: ``zero`` scores the sample 0 and counts it (``reward/timeouts``); ``error``
    stops the run naming the sample's index and data_source."""
    num_workers: int = 0
    """Worker processes per rank for reward functions under ``timeout_s`` (they also spread slow checkers over cores).
    0: the CPU cores per local rank, at most 8."""


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
    hang_warn_s: float = 300.0
    """Rank 0 warns (naming the rank, its stage, step and seconds) when a rank has been in one stage of a step (``gen``,
    ``reward``, ``update_actor``, ...) longer than this, and repeats every ``hang_warn_s`` while it lasts. Below
    ``timeout_s``, so the late rank is named before a collective times out. 0 disables the warning."""
    hang_timeout_s: float = 7200.0
    """End the job (non-zero exit on every rank, the message naming the rank and stage) when a rank has been in one
    stage longer than this. Far above any one stage of a healthy run (generating a long batch can take many minutes);
    raise it for longer ones. 0 disables it."""


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
    GPU-scale ``config``.
    """
    path, name = _split_selector(str(path))
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
    if not hasattr(module, name):
        if name != "config":
            known = sorted(
                k for k, v in vars(module).items()
                if not k.startswith("_")
                and (isinstance(v, expected_type) or (callable(v) and not isinstance(v, type) and getattr(v, "__module__", None) == module_name))
            )
            raise ValueError(f"config file {path} has no `{name}` (selected by `:{name}`); it defines {known}")
        raise ValueError(f"config file {path} must define `config = {expected_type.__name__}(...)` or a function `config()`")
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


def ignored_settings(cfg: Config) -> list[str]:
    """Settings that differ from their defaults but do nothing under the switches that gate them (warned once)."""
    alg, out = cfg.algorithm, []
    if not alg.norm_adv_by_std and alg.adv_estimator not in ("grpo", "grpo_passk"):
        out.append(f"algorithm.norm_adv_by_std=False applies to grpo and grpo_passk, not {alg.adv_estimator!r}")
    if alg.adv_estimator != "gae" and cfg.critic != CriticConfig():
        out.append(f"critic.* is set but algorithm.adv_estimator={alg.adv_estimator!r} uses no critic")
    if not alg.use_kl_in_reward and (alg.kl_ctrl != KLControlConfig() or alg.kl_penalty != AlgorithmConfig.kl_penalty):
        out.append("algorithm.kl_ctrl / kl_penalty are set but algorithm.use_kl_in_reward=False")
    if not alg.filter_groups.enable and alg.filter_groups != FilterGroupsConfig():
        out.append("algorithm.filter_groups.* is set but algorithm.filter_groups.enable=False")
    if not cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer != OverlongBufferConfig():
        out.append("reward.overlong_buffer.* is set but reward.overlong_buffer.enable=False")
    if cfg.reward.model.path is None and cfg.reward.model != RewardModelConfig():
        out.append("reward.model.* is set but reward.model.path is None")
    if not cfg.actor.use_kl_loss and (cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) != (ActorConfig.kl_loss_coef, ActorConfig.kl_loss_type):
        out.append("actor.kl_loss_coef / kl_loss_type are set but actor.use_kl_loss=False")
    return out


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
