"""Typed configuration: the single source of truth for every option.

A run is a Python file that defines ``config = Config(...)`` (or a function ``config()`` returning one);
``rlspmd.train`` loads it and lets ``tyro`` apply command-line overrides such as
``--actor.optim.lr 1e-6``. The docstring under each field is what ``--help`` shows.

Sections are handed to the code that reads them (``RolloutConfig`` to the rollout engine, ``OptimConfig`` to
the optimiser builder, ...); nothing receives the whole tree except the trainer that wires the roles.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from functools import partial
from typing import Annotated, ClassVar, Literal, Union

import tyro


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
    """Remove padding: run each micro-batch's valid tokens as one packed sequence with per-sample boundaries (the
    attention kernel is ``attn_kernel``). Same results as the padded forward, less compute. Needs
    ``attn_implementation`` ``sdpa`` or ``flash_attention_2``."""
    attn_kernel: Literal["auto", "flash_attn", "varlen", "flex", "sdpa_loop"] = "auto"
    """Packed attention kernel (``packing`` with ``attn_implementation=sdpa``): ``flash_attn`` (flash-attn's varlen
    kernel; CUDA, bf16/fp16, needs the package), ``varlen`` (torch's ``varlen_attn``, FlashAttention-2 in libtorch;
    CUDA sm80+, bf16/fp16), ``flex`` (compiled FlexAttention with a document-causal block mask; CUDA), ``sdpa_loop``
    (one SDPA call per sample; any device). ``auto``: on CUDA the first of flash_attn, varlen, flex that runs on the
    device and compute dtype, else sdpa_loop (what CPU uses). One that cannot run here stops the run at start-up."""
    sharded_load: bool = True
    """Build the model on the meta device, apply the parallelism, then read only this rank's slices of the safetensors
    files (peak host memory per rank: its shards plus one slice, not the whole model). Keys are matched by name; False
    loads the whole model on every rank with ``from_pretrained`` and shards it (for ``*.bin`` checkpoints, or
    architectures whose checkpoints need transformers' key conversions)."""


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


# -- training engines: each a component with its own options and checks ---------------------------------------------
#
# ``actor.engine`` and ``critic.engine`` hold one of these (the reference runs on the actor's). On the command line an
# engine is a subcommand and its options follow it (``actor.engine:megatron --actor.engine.tp 2``); the default FSDP
# engine's options need none (``--actor.engine.cpu-offload``). An option of the other engine is an error, not silently
# ignored. ``rlspmd.trainer.build.build_engine`` builds the engine a component describes.


@dataclass
class FSDPConfig:
    """The FSDP2 engine: ``fully_shard`` on each decoder layer, then the root; every feature (LoRA, ``mesh.actor_tp``,
    CPU offload, packing). ``SFTConfig.fsdp`` is one too."""

    name: ClassVar[str] = "fsdp"
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of unsharded parameters. ``auto``: bfloat16 on CUDA, float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduce-scatter."""
    reshard_after_forward: bool = True
    """Free unsharded parameters after each layer's forward (ZeRO-3). False keeps them until backward (ZeRO-2-like)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU (FSDP2 CPUOffloadPolicy)."""

    def problems(self) -> list[Problem]:
        return []  # any value of each option's type runs (the types are checked by rlspmd.validate)


@dataclass
class MegatronConfig:
    """The megatron-core engine (``engine=MegatronConfig(...)``; needs the ``megatron`` extra) and its layout.

    The role's ranks form a (pp, dp, tp) grid, tp fastest (megatron's default order): ``dp = ranks / (tp * pp)``.
    The trainer still hands every rank its own samples; the ``tp x pp`` ranks of a model replica run each
    micro-batch on their samples together and each keeps its own rows of the outputs."""

    name: ClassVar[str] = "megatron"
    tp: int = 1
    """Tensor-parallel degree (consecutive ranks). Must divide the model's KV heads, vocabulary and FFN size."""
    pp: int = 1
    """Pipeline-parallel degree: stages of consecutive layers (must divide the model's layers). The loss runs on the
    last stage; megatron's 1F1B schedule on CUDA, a GPipe schedule on CPU (docs/megatron.md)."""
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of forwards (autocast; parameters and optimiser state stay in ``model.dtype``). ``auto``: bfloat16
    on CUDA, float32 on CPU."""

    def problems(self) -> list[Problem]:
        return [(name, v, "must be >= 1") for name, v in (("tp", self.tp), ("pp", self.pp)) if v < 1]


ENGINE_TYPES = {c.name: c for c in (FSDPConfig, MegatronConfig)}
"""Every training engine by its name (the command line's subcommand)."""

Engine = Union[tuple(Annotated[c, tyro.conf.subcommand(name)] for name, c in ENGINE_TYPES.items())]
"""``actor.engine`` / ``critic.engine``: one of the engines above."""


@dataclass
class LoraConfig:
    """LoRA fine-tuning of the policy through ``peft`` (``rank`` > 0): only the adapters train, are sharded with the
    model and have optimiser state; the reference is the base model (the adapters switched off: no second copy of the
    weights); the rollout generates with the adapters merged; checkpoints hold the adapters and their optimiser
    state; ``scripts/export_hf.py`` writes a merged model and the peft adapter."""

    rank: int = 0
    """Adapter rank r; 0 trains every weight (no LoRA)."""
    alpha: float = 16.0
    """Scaling numerator: an adapter adds ``alpha / rank * B A x`` to its layer's output."""
    dropout: float = 0.0
    """Dropout on the adapters' input in every actor forward that runs in training mode (the log-prob passes of the
    update included, so keep 0 for exact PPO ratios)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Layers that get adapters, by name suffix (``q_proj``, ``v_proj``, ...), or ``all-linear`` (peft: every linear
    layer except the LM head)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


# -- policy losses: each a component with its own options, checks and bound loss ------------------------------------
#
# ``actor.policy_loss`` holds one of these. On the command line a loss is a subcommand and its options follow it
# (``actor.policy-loss:gspo --actor.policy-loss.clip-ratio-low 3e-4``); an option of another loss is an error, not
# silently ignored. ``build()`` binds the options to the pure function in ``rlspmd.algorithms.losses`` (imported
# there, so that reading a config needs no torch).

Problem = tuple[str, object, str]
"""``(field, value, why)``: one thing wrong with a component's options; the collector (``rlspmd.validate``) prefixes
the field with where the component sits."""


def _clip_problems(low: float, high: float) -> list[Problem]:
    return [(name, v, "must be >= 0") for name, v in (("clip_ratio_low", low), ("clip_ratio_high", high)) if v < 0]


def _fraction_problems(name: str, value: float) -> list[Problem]:
    return [] if 0 < value <= 1 else [(name, value, "must be in (0, 1] (a fraction of a micro-batch's valid tokens)")]


@dataclass
class PPOClip:
    """PPO's clipped surrogate with an asymmetric clip range and dual clip (verl: ``vanilla``)."""

    name: ClassVar[str] = "ppo_clip"
    per_sequence: ClassVar[bool] = False
    clip_ratio_low: float = 0.2
    """Ratio lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Ratio upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher raises it, e.g. 0.28)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound for negative advantages (> 1; None disables dual clip)."""

    def problems(self) -> list[Problem]:
        dual = (
            []
            if self.clip_ratio_c is None or self.clip_ratio_c > 1
            else [("clip_ratio_c", self.clip_ratio_c, "the dual-clip bound must be > 1, or None (off)")]
        )
        return _clip_problems(self.clip_ratio_low, self.clip_ratio_high) + dual

    def build(self, *, generator=None):
        from rlspmd.algorithms.losses import ppo_clip

        return partial(
            ppo_clip, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c
        )


@dataclass
class GSPO:
    """GSPO: a sequence-level ratio (the geometric mean of the token ratios), whole sequences clipped; aggregates
    ``seq-mean-token-mean`` whatever ``actor.loss_agg_mode`` says, as verl does."""

    name: ClassVar[str] = "gspo"
    per_sequence: ClassVar[bool] = True
    clip_ratio_low: float = 3e-4
    """Sequence-ratio lower clip (the paper's 3e-4)."""
    clip_ratio_high: float = 4e-4
    """Sequence-ratio upper clip (the paper's 4e-4)."""

    def problems(self) -> list[Problem]:
        return _clip_problems(self.clip_ratio_low, self.clip_ratio_high)

    def build(self, *, generator=None):
        from rlspmd.algorithms.losses import gspo

        return partial(gspo, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high)


@dataclass
class CISPO:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient ratio; no token is dropped."""

    name: ClassVar[str] = "cispo"
    per_sequence: ClassVar[bool] = False
    clip_ratio_low: float = 0.2
    """The weight's lower bound: 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """The weight's upper bound: 1 + clip_ratio_high."""

    def problems(self) -> list[Problem]:
        return _clip_problems(self.clip_ratio_low, self.clip_ratio_high)

    def build(self, *, generator=None):
        from rlspmd.algorithms.losses import cispo

        return partial(cispo, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high)


@dataclass
class SAPO:
    """SAPO: a smooth, temperature-controlled gate on the ratio instead of a hard clip; aggregates
    ``seq-mean-token-mean``."""

    name: ClassVar[str] = "sapo"
    per_sequence: ClassVar[bool] = True
    tau_pos: float = 1.0
    """Gate temperature for tokens with a positive advantage (> 0)."""
    tau_neg: float = 1.05
    """Gate temperature for tokens with a non-positive advantage (> 0)."""

    def problems(self) -> list[Problem]:
        return [
            (name, tau, "must be > 0")
            for name, tau in (("tau_pos", self.tau_pos), ("tau_neg", self.tau_neg))
            if not tau > 0
        ]

    def build(self, *, generator=None):
        from rlspmd.algorithms.losses import sapo

        return partial(sapo, tau_pos=self.tau_pos, tau_neg=self.tau_neg)


@dataclass
class GPG:
    """GPG's plain policy gradient, loss = -A logp (no ratio, no clip; no options). Pair with
    ``algorithm.adv_estimator=GPGAdvantage()`` (``algorithm.adv-estimator:gpg``)."""

    name: ClassVar[str] = "gpg"
    per_sequence: ClassVar[bool] = False

    def problems(self) -> list[Problem]:
        return []

    def build(self, *, generator=None):
        from rlspmd.algorithms.losses import gpg_loss

        return gpg_loss


@dataclass
class GMPO:
    """GMPO: the geometric mean of the clipped token ratios, one objective per sequence; aggregates
    ``seq-mean-token-mean``."""

    name: ClassVar[str] = "gmpo"
    per_sequence: ClassVar[bool] = True
    clip_ratio_low: float = 0.2
    """Log-ratio lower clip (the clip acts on log r in [-clip_ratio_low, clip_ratio_high])."""
    clip_ratio_high: float = 0.2
    """Log-ratio upper clip."""

    def problems(self) -> list[Problem]:
        return _clip_problems(self.clip_ratio_low, self.clip_ratio_high)

    def build(self, *, generator=None):
        from rlspmd.algorithms.losses import gmpo

        return partial(gmpo, clip_low=self.clip_ratio_low, clip_high=self.clip_ratio_high)


@dataclass
class ClipCov:
    """Clip-Cov: PPO's clipped loss with the gradient of a few high-covariance tokens removed, drawn per
    micro-batch (so its gradient depends on the micro-batching)."""

    name: ClassVar[str] = "clip_cov"
    per_sequence: ClassVar[bool] = False
    clip_ratio_low: float = 0.2
    """PPO ratio lower clip."""
    clip_ratio_high: float = 0.2
    """PPO ratio upper clip."""
    clip_cov_ratio: float = 2e-4
    """Fraction of a micro-batch's valid tokens, drawn at random among those whose advantage-logprob covariance lies in
    (``clip_cov_lb``, ``clip_cov_ub``), whose gradient is removed (at least one token). In (0, 1]."""
    clip_cov_lb: float = 1.0
    """Lower bound of the covariance band that can be drawn."""
    clip_cov_ub: float = 5.0
    """Upper bound of the covariance band that can be drawn (> ``clip_cov_lb``)."""

    def problems(self) -> list[Problem]:
        band = (
            []
            if self.clip_cov_lb < self.clip_cov_ub
            else [("clip_cov_lb", self.clip_cov_lb, f"must be < clip_cov_ub={self.clip_cov_ub}")]
        )
        return (
            _clip_problems(self.clip_ratio_low, self.clip_ratio_high)
            + _fraction_problems("clip_cov_ratio", self.clip_cov_ratio)
            + band
        )

    def build(self, *, generator=None):
        """``generator``: the seeded draws of the tokens (per rank)."""
        from rlspmd.algorithms.losses import clip_cov

        return partial(
            clip_cov,
            clip_low=self.clip_ratio_low,
            clip_high=self.clip_ratio_high,
            clip_cov_ratio=self.clip_cov_ratio,
            clip_cov_lb=self.clip_cov_lb,
            clip_cov_ub=self.clip_cov_ub,
            generator=generator,
        )


@dataclass
class KLCov:
    """KL-Cov: the unclipped policy gradient plus a KL penalty on the tokens of largest advantage-logprob covariance,
    chosen per micro-batch (so its gradient depends on the micro-batching)."""

    name: ClassVar[str] = "kl_cov"
    per_sequence: ClassVar[bool] = False
    kl_cov_ratio: float = 2e-4
    """Fraction of a micro-batch's valid tokens, those of largest covariance, that get the penalty
    ``kl_cov_coef * |logp - old_logp|`` (at least one token). In (0, 1]. The paper's recipes: 2e-3 for 7B models,
    2e-4 for 32B."""
    kl_cov_coef: float = 0.1
    """Coefficient of the penalty on the selected tokens (verl's ``ppo_kl_coef``; the paper's recipes use 1.0)."""

    def problems(self) -> list[Problem]:
        coef = [] if self.kl_cov_coef >= 0 else [("kl_cov_coef", self.kl_cov_coef, "must be >= 0")]
        return _fraction_problems("kl_cov_ratio", self.kl_cov_ratio) + coef

    def build(self, *, generator=None):
        from rlspmd.algorithms.losses import kl_cov

        return partial(kl_cov, kl_cov_ratio=self.kl_cov_ratio, kl_cov_coef=self.kl_cov_coef)


POLICY_LOSS_TYPES = {c.name: c for c in (PPOClip, GSPO, CISPO, SAPO, GPG, GMPO, ClipCov, KLCov)}
"""Every policy loss by its name (the command line's subcommand, with ``-`` for ``_``)."""

PolicyLoss = Union[tuple(Annotated[c, tyro.conf.subcommand(name)] for name, c in POLICY_LOSS_TYPES.items())]
"""``actor.policy_loss``: one of the components above."""


@dataclass
class TrainedRoleConfig:
    """What the actor and the critic share: the engine they train on, how a step's batch splits into optimiser steps
    and micro-batches (``rlspmd.trainer.build.role_plan`` reads exactly these), and how their loss is aggregated."""

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
class MoEConfig:
    """The actor's mixture-of-experts options (Qwen3-MoE / Qwen2-MoE models; ``models/moe.py``, docs/moe.md). Expert
    parallelism is a mesh dim: ``mesh.actor_ep``."""

    aux_loss_coef: float | None = None
    """Coefficient of the router's load-balancing loss in the actor's loss (``actor/moe_aux_loss`` is logged either
    way); None: the model's own ``router_aux_loss_coef`` (config.json), 0: off."""
    router_replay: Literal["off", "R2", "R3"] = "off"
    """Routing replay in the actor's passes. ``R2``: the update reuses the experts the old-log-prob pass routed each
    token to (so the ratio's numerator and denominator route alike). ``R3``: the old-log-prob pass and the update
    both use the experts the rollout engine routed each token to, recorded with the sample (native engine; vLLM
    where it can return them), so training routes as generation did. The gate weights always come from the current
    router (it keeps its gradient)."""

    def problems(self) -> list[Problem]:
        if self.aux_loss_coef is not None and not self.aux_loss_coef >= 0:
            return [("aux_loss_coef", self.aux_loss_coef, "must be >= 0, or None (the model's router_aux_loss_coef)")]
        return []


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
    policy_loss: PolicyLoss = field(default_factory=PPOClip)
    """Policy loss and its options: ``PPOClip()`` (the default), ``GSPO()``, ``CISPO()``, ``SAPO()``, ``GPG()``,
    ``GMPO()``, ``ClipCov()``, ``KLCov()``. On the command line: ``actor.policy-loss:gspo`` picks one, then
    ``--actor.policy-loss.<option>``. gspo, sapo and gmpo aggregate their loss ``seq-mean-token-mean`` whatever
    ``loss_agg_mode`` says (as verl does); ``loss_agg_mode`` still applies to the KL and entropy terms."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef * entropy)."""
    use_kl_loss: bool = True
    """Add a KL(policy || reference) term to the loss (GRPO). Needs the reference model."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss term."""
    kl_loss_type: str = "k3"
    """KL estimator for the loss term: k1 (kl), abs, k2 (mse), k3 (low_var_kl), or any of them with '+' (the value
    of that estimator with k2's gradient, e.g. ``k3+``, ``low_var_kl+``, ``abs+``): verl's names."""
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
class CodeRunnerConfig:
    timeout_s: float = 5.0
    """Wall-time limit of one run of the ``python`` tool; the process group is killed when it passes."""
    memory_mb: int = 512
    """Address-space limit of the run (``RLIMIT_AS``): larger allocations fail with ``MemoryError``."""
    cpu_s: int = 5
    """CPU-time limit of the run (``RLIMIT_CPU``)."""
    max_output_chars: int = 2000
    """Output (stdout and stderr) the model reads back; the rest is cut and marked ``[output truncated]``."""
    sandbox: Literal["bwrap", "audit-hook-unsafe"] = "bwrap"
    """Isolation of the model's code (``rlspmd/agent/sandbox.py``; docs/agents.md, "The python tool's sandbox"): ``bwrap``,
    bubblewrap namespaces (sees only its own directory and the standard library, no network, own PID namespace,
    unprivileged identity); the tool refuses to start, naming what is missing, where they cannot be created.
    ``audit-hook-unsafe``, an explicit opt-in for such machines: a Python audit hook, which the code can step around,
    and it can read every file the trainer can (data, ground truth, checkpoints)."""


@dataclass
class AgentConfig:
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: registered names (``calculator``, ``calc_gsm8k_reward`` alias ``gsm8k_answer``,
    ``python``) or ``path/to/file.py:Class`` / ``module:Class`` (``rlspmd.agent.Tool``'s interface). Non-empty (or an
    ``interaction``) turns every rollout into a multi-turn conversation; the schemas are rendered into every prompt
    through the chat template's ``tools`` argument. Checked at start-up (import, members, schema)."""
    tool_prompt: Literal["template", "system"] = "template"
    """How the tool schemas reach the prompt: ``template``, the chat template's ``tools`` argument (start-up error if
    the template ignores it); ``system``, rlspmd writes them into the system message itself (a ``<tools>`` block and
    the ``<tool_call>`` syntax the ``hermes`` parser reads) for templates without tool support, e.g. SmolLM2's. The
    run's tokenizer then renders that way everywhere: prompts, appended turns, the ``checkpoint.save_hf`` export."""
    parser: str = "hermes"
    """Tool-call format: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen's) or
    ``path/to/file.py:Class`` with ``parse(text) -> list[ToolCall | ParseError]``."""
    max_turns: int = 4
    """Assistant turns per conversation; a turn that calls tools past the last one ends the conversation."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run; a call past it is an error message to the model (counted as a timeout)."""
    max_parallel_tools: int = 16
    """Tool calls running at once on a rank (threads; a conversation's calls of one turn run in order)."""
    max_tool_response_chars: int = 1000
    """A tool result (or error) longer than this is cut before it is appended."""
    interaction: str | None = None
    """User simulator after each answer without a tool call: ``gsm8k`` or ``path/to/file.py:Class``; None: none.
    Named as verl names an interaction (``gsm8k``; a class ``FooInteraction`` is ``foo``): a row whose
    ``extra_info.interaction_kwargs.name`` names another is a start-up error; a row without a name gets it."""
    tool_config_path: str | None = None
    """verl's ``tool_config`` YAML, as verl's examples write it (``tools:`` a list of ``{class_name, config,
    tool_schema}``; verl's ``actor_rollout_ref.rollout.multi_turn.tool_config_path``): its tools join
    ``rollout.agent.tools``. verl's ``verl.tools.gsm8k_tool.Gsm8kTool`` is the built-in ``calc_gsm8k_reward``; user
    classes by ``pkg.mod.Class``, ``pkg.mod:Class`` or ``path/to/file.py:Class``, built as ``Class(**config)``;
    ``tool_schema`` is what the model sees. What rlspmd cannot honour (MCP tools, other verl classes, unknown keys) is a
    start-up error naming the file and the entry (``rlspmd/agent/verl_config.py``)."""
    interaction_config_path: str | None = None
    """verl's ``interaction_config`` YAML (``interaction:`` a list of ``{name, class_name, config}``; verl's
    ``...multi_turn.interaction_config_path``): several named interactions per run, each row choosing one by
    ``extra_info.interaction_kwargs.name`` (a row without a name needs the run to have exactly one).
    ``verl.interactions.gsm8k_interaction.Gsm8kInteraction`` is the built-in ``gsm8k``."""
    default_agent_loop: Literal["tool_agent", "single_turn_agent"] = "tool_agent"
    """The agent of a row without an ``agent_name`` column (verl's ``rollout.agent.default_agent_loop``):
    ``tool_agent``, the multi-turn conversation; ``single_turn_agent``, one response (the tools' schemas still in the
    prompt, no call run, no interaction). verl's default is ``single_turn_agent``; rlspmd's is ``tool_agent``, since a
    run that configures tools means to use them. A row's ``agent_name`` outside these two is a start-up error."""
    max_user_turns: int = 1
    """Interaction replies per conversation."""
    code: CodeRunnerConfig = field(default_factory=CodeRunnerConfig)
    """Limits of the ``python`` tool."""

    @property
    def enabled(self) -> bool:
        return (
            bool(self.tools)
            or self.interaction is not None
            or self.tool_config_path is not None
            or self.interaction_config_path is not None
        )


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
    """Native engine: run the static-shape decode step (``cuda_graphs``' step: it attends over the whole preallocated
    KV cache under a mask, finished rows stay in the batch) through ``torch.compile`` (Llama-family models); with
    ``cuda_graphs`` on CUDA the compiled step is what the graphs capture. The first generations pay the compile time.
    Same tokens as the eager step (tested on CPU). On a 2-core CPU it is no faster than eager (measured 1.11 s vs
    1.02 s per 64 x 128 generation)."""
    cuda_graphs: bool = True
    """Native engine on CUDA (Llama-family models with a static RoPE table): a static KV cache, the decode step
    (model, sampling and bookkeeping, no host sync) captured in one CUDA graph per batch size and replayed for every
    token, finished rows checked every 16 tokens, prefill as one forward. Graphs are captured at the start of each
    generation, while the weights are gathered in place, and released at its end. Same greedy tokens as eager
    decoding (tested on CPU for the uncaptured step; the captured graphs by a ``gpu``-marked test, not yet run on a
    GPU). No effect on CPU or for other architectures (they decode eagerly). False: eager decoding."""
    ignore_eos: bool = False
    """Training rollouts never sample EOS, so every response has exactly ``max_response_length`` tokens (a fixed
    workload for benchmarks, like vLLM's ``ignore_eos`` + ``min_tokens``). Validation is unaffected."""
    val_temperature: float = 0.0
    """Sampling temperature for validation (0 = greedy)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the rollout engine's weights. ``auto``: the actor's compute dtype (``actor.engine.param_dtype``).
    The weight stream casts shards to it before gathering. The colocated native engine reads the actor's gathered
    weights in place when it equals the compute dtype, and keeps its own copy otherwise."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """Settings of the ``vllm`` engine (ignored by ``native``)."""
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


# -- KL controllers: the coefficient of the in-reward KL penalty (``algorithm.kl_ctrl``) ----------------------------
#
# Picked by name like the policy loss: ``algorithm.kl-ctrl:adaptive --algorithm.kl-ctrl.target-kl 0.02``.


@dataclass
class FixedKL:
    """The coefficient stays ``kl_coef``."""

    name: ClassVar[str] = "fixed"
    kl_coef: float = 0.001
    """Coefficient of the per-token KL penalty in the reward (>= 0)."""

    def problems(self) -> list[Problem]:
        return [] if self.kl_coef >= 0 else [("kl_coef", self.kl_coef, "must be >= 0")]

    def build(self):
        from rlspmd.algorithms.kl import FixedKLController

        return FixedKLController(self.kl_coef)


@dataclass
class AdaptiveKL:
    """The coefficient is steered toward ``target_kl`` (Ziegler et al. 2019) by the mean over samples of each sample's
    mean KL, over the global batch."""

    name: ClassVar[str] = "adaptive"
    kl_coef: float = 0.001
    """Initial coefficient of the per-token KL penalty in the reward (>= 0)."""
    target_kl: float = 0.1
    """The per-token KL the controller steers toward (> 0)."""
    horizon: float = 10000.0
    """Samples over which a 20% coefficient change is reached (the controller's time constant; > 0)."""

    def problems(self) -> list[Problem]:
        coef = [] if self.kl_coef >= 0 else [("kl_coef", self.kl_coef, "must be >= 0")]
        return coef + [
            (name, v, "must be > 0")
            for name, v in (("target_kl", self.target_kl), ("horizon", self.horizon))
            if not v > 0
        ]

    def build(self):
        from rlspmd.algorithms.kl import AdaptiveKLController

        return AdaptiveKLController(self.kl_coef, self.target_kl, self.horizon)


KL_CONTROL_TYPES = {c.name: c for c in (FixedKL, AdaptiveKL)}
"""Every KL controller by its name (the command line's subcommand)."""

KLControl = Union[tuple(Annotated[c, tyro.conf.subcommand(name)] for name, c in KL_CONTROL_TYPES.items())]
"""``algorithm.kl_ctrl``: one of the controllers above."""


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
class RolloutCorrectionConfig:
    """Correct the policy loss for the rollout engine's probabilities differing from the trainer's.

    With rho = pi_train / pi_rollout of each sampled token (``old_logprobs`` over the engine's ``rollout_logprobs``),
    or of each sequence as the geometric mean of its token ratios: ``tis`` multiplies each token's loss by
    min(rho, ``tis_threshold``) (truncated importance sampling), ``mis`` drops tokens or whole sequences whose rho
    leaves [``mis_lower``, ``mis_upper``] from the loss (masked importance sampling / rejection), ``both`` does both.
    The weights' and the mismatch's metrics (``rollout_corr/*``) are logged in every mode.
    """

    mode: Literal["auto", "off", "tis", "mis", "both"] = "auto"
    """``auto``: ``mis`` when the rollout's numerics differ from training (the vLLM engine, a rollout dtype unlike
    the actor's compute dtype), ``tis`` for asynchronous rollouts with stale weights (``trainer.max_staleness`` > 0:
    an update moves the ratio far past the rejection band), ``off`` for the native engine in the actor's compute
    dtype (it samples from the trainer's own weights and kernels). Or ``off``, ``tis``, ``mis``, ``both``
    explicitly."""
    level: Literal["token", "sequence"] = "sequence"
    """The ratio per token, or per sequence as the geometric mean of its token ratios (length-normalised; verl and
    TRL's sequence modes use the product, which drifts from 1 on long responses)."""
    tis_threshold: float = 2.0
    """Truncation cap of the importance weights (``tis``, ``both``); verl's default."""
    mis_lower: float | None = None
    """Lower end of the ratio band a token / sequence must lie in to stay (``mis``, ``both``). None: 0.999 at
    ``sequence`` level (verl's geometric rejection preset, +-0.1%), 0.5 at ``token`` level."""
    mis_upper: float | None = None
    """Upper end of the band. None: 1.001 at ``sequence`` level, 2.0 at ``token`` level."""
    metric_ratio_bound: float = 2.0
    """c of the metric ``rollout_corr/mismatch/ratio_out_of_bound_frac``: the share of tokens whose ratio leaves
    [1/c, c]."""
    bypass: bool = False
    """Use the rollout's log-probs as the old log-probs and skip the old-log-prob forward (verl's bypass mode).
    Only with one optimiser update per step (``actor.ppo_epochs=1``, ``actor.mini_batch_size`` =
    ``data.train_batch_size``) and the correction on: PPO's ratio is then pi_theta / pi_rollout, so its clip bounds
    the mismatch too, and the rejection band is applied against the current policy inside the loss. Trade-off:
    one forward fewer per step, but the clip now also spends its range on the engine mismatch."""

    def problems(self) -> list[Problem]:
        """Its own checks, collected by ``rlspmd.validate``. Every mode reads every threshold: the metrics show what
        truncation and rejection would do even where the mode applies neither, and ``auto`` may pick either."""
        out = [] if self.tis_threshold > 0 else [("tis_threshold", self.tis_threshold, "must be > 0")]
        lower, upper = self.band()
        if not 0 < lower < upper:
            out.append(
                (
                    "mis_lower",
                    self.mis_lower,
                    f"and mis_upper={self.mis_upper} must satisfy 0 < lower < upper "
                    f"(with the {self.level} level's defaults: {lower}, {upper})",
                )
            )
        if not self.metric_ratio_bound > 1:
            out.append(("metric_ratio_bound", self.metric_ratio_bound, "must be > 1"))
        return out

    def band(self) -> tuple[float, float]:
        """The rejection band [mis_lower, mis_upper] with the level's defaults filled in."""
        default_lower, default_upper = (0.999, 1.001) if self.level == "sequence" else (0.5, 2.0)
        return (
            default_lower if self.mis_lower is None else self.mis_lower,
            default_upper if self.mis_upper is None else self.mis_upper,
        )


# -- advantage estimators: each a component with its own options, checks and bound estimator -------------------------
#
# ``algorithm.adv_estimator`` holds one of these, picked like the policy loss: ``algorithm.adv-estimator:gae
# --algorithm.adv-estimator.lam 0.95``. ``build(all_reduce=...)`` binds the options to the estimator of
# ``rlspmd.algorithms.estimators`` that the advantage stage calls on a batch; ``all_reduce`` is the stage's sum over
# the DP ranks. The class variables say what the rest of the run must provide: a critic (``uses_critic``), one greedy
# response per prompt, scored (``uses_greedy_baseline``), or the reward components instead of the token rewards
# (``uses_reward_components``).


NoFlag = tyro.conf.FlagConversionOff
"""A bool option of an estimator is written ``--algorithm.adv-estimator.norm-adv-by-std False``: tyro (1.0.17) accepts
a ``--no-...`` flag of a component only after its subcommand, a value also for the component a config file chose."""


def _unit_interval_problems(**values: float) -> list[Problem]:
    return [(name, v, "must be in [0, 1]") for name, v in values.items() if not 0 <= v <= 1]


def _eps_problems(eps: float) -> list[Problem]:
    return [] if eps >= 0 else [("eps", eps, "must be >= 0")]


class _Estimator:
    """What an estimator needs besides the token rewards; most need nothing."""

    uses_critic: ClassVar[bool] = False
    uses_greedy_baseline: ClassVar[bool] = False
    uses_reward_components: ClassVar[bool] = False

    def problems(self) -> list[Problem]:
        return []


@dataclass
class GAE(_Estimator):
    """PPO's generalised advantage estimation over the critic's values (builds the critic: ``critic.*``), whitened
    over the global batch."""

    name: ClassVar[str] = "gae"
    uses_critic: ClassVar[bool] = True
    gamma: float = 1.0
    """Discount factor, in [0, 1]."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]."""

    def problems(self) -> list[Problem]:
        return _unit_interval_problems(gamma=self.gamma, lam=self.lam)

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import gae_estimate

        return partial(gae_estimate, gamma=self.gamma, lam=self.lam, all_reduce=all_reduce)


@dataclass
class GRPO(_Estimator):
    """GRPO: each sample's score relative to its group's (the samples of one prompt) mean, divided by the group std.
    ``norm_adv_by_std=False`` is Dr.GRPO."""

    name: ClassVar[str] = "grpo"
    norm_adv_by_std: NoFlag[bool] = True
    """Divide by the group std (``--algorithm.adv-estimator.norm-adv-by-std False``: Dr.GRPO, centring only)."""
    eps: float = 1e-6
    """Added to the group std (verl's ``epsilon``, >= 0); a group of one sample keeps score / (1 + eps)."""

    def problems(self) -> list[Problem]:
        return _eps_problems(self.eps)

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import grpo_estimate

        return partial(grpo_estimate, norm_adv_by_std=self.norm_adv_by_std, eps=self.eps)


@dataclass
class GRPOPassK(_Estimator):
    """pass@k GRPO: only the best sample of a group gets an advantage, its margin over the second best."""

    name: ClassVar[str] = "grpo_passk"
    norm_adv_by_std: NoFlag[bool] = True
    """Divide by the group std."""
    eps: float = 1e-6
    """Added to the group std (>= 0)."""

    def problems(self) -> list[Problem]:
        return _eps_problems(self.eps)

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import grpo_passk_estimate

        return partial(grpo_passk_estimate, norm_adv_by_std=self.norm_adv_by_std, eps=self.eps)


@dataclass
class RLOO(_Estimator):
    """RLOO: each sample's score minus the mean of the other samples of its group (no options)."""

    name: ClassVar[str] = "rloo"

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import rloo_estimate

        return rloo_estimate


@dataclass
class ReinforcePP(_Estimator):
    """REINFORCE++: the discounted return-to-go of the (KL-penalised) token rewards, whitened over the global batch;
    no critic, no group baseline."""

    name: ClassVar[str] = "reinforce_pp"
    gamma: float = 1.0
    """Discount factor, in [0, 1]."""

    def problems(self) -> list[Problem]:
        return _unit_interval_problems(gamma=self.gamma)

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import reinforce_pp_estimate

        return partial(reinforce_pp_estimate, gamma=self.gamma, all_reduce=all_reduce)


@dataclass
class ReinforcePPBaseline(_Estimator):
    """REINFORCE++-baseline: the score minus its group's mean, whitened over the global batch (no options)."""

    name: ClassVar[str] = "reinforce_pp_baseline"

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import reinforce_pp_baseline_estimate

        return partial(reinforce_pp_baseline_estimate, all_reduce=all_reduce)


@dataclass
class ReMax(_Estimator):
    """ReMax: the reward-to-go minus the score of one greedy response per prompt, generated and scored in the rollout
    stage (no options)."""

    name: ClassVar[str] = "remax"
    uses_greedy_baseline: ClassVar[bool] = True

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import remax_estimate

        return remax_estimate


@dataclass
class OPO(_Estimator):
    """OPO: the score minus its group's length-weighted mean score (no options)."""

    name: ClassVar[str] = "opo"

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import opo_estimate

        return opo_estimate


@dataclass
class GPGAdvantage(_Estimator):
    """GPG's advantage: the group-centred score scaled by alpha (rows over rows with a non-zero score, over the global
    batch); F_norm = 1, its paper's best setting (no options). Pair with ``actor.policy_loss=GPG()``."""

    name: ClassVar[str] = "gpg"

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import gpg_estimate

        return partial(gpg_estimate, all_reduce=all_reduce)


@dataclass
class GDPO(_Estimator):
    """GDPO: several rewards (``reward_components_BK``: the rule score, the reward model's, then each of
    ``reward.components``), each normalised within its group, weighted, summed and whitened over the global batch.
    KL in the reward and overlong shaping do not reach it (they shape the token rewards it does not read)."""

    name: ClassVar[str] = "gdpo"
    uses_reward_components: ClassVar[bool] = True
    reward_weights: list[float] | None = None
    """Weight of each reward component, one per column of ``reward_components_BK`` in its order: the rule / function
    score, the reward model's score (with ``reward.model.path``), the agent's (with ``rollout.agent``), then each of
    ``reward.components``. None: all 1."""
    norm_adv_by_std: NoFlag[bool] = True
    """Divide each component by its group std."""
    eps: float = 1e-6
    """Added to each group std (>= 0)."""

    def problems(self) -> list[Problem]:
        return _eps_problems(self.eps)

    def build(self, *, all_reduce):
        from rlspmd.algorithms.estimators import gdpo_estimate

        return partial(
            gdpo_estimate,
            reward_weights=self.reward_weights,
            norm_adv_by_std=self.norm_adv_by_std,
            eps=self.eps,
            all_reduce=all_reduce,
        )


ADVANTAGE_ESTIMATOR_TYPES = {
    c.name: c for c in (GAE, GRPO, GRPOPassK, RLOO, ReinforcePP, ReinforcePPBaseline, ReMax, OPO, GPGAdvantage, GDPO)
}
"""Every advantage estimator by its name (the command line's subcommand, with ``-`` for ``_``)."""

AdvantageEstimator = Union[
    tuple(Annotated[c, tyro.conf.subcommand(name)] for name, c in ADVANTAGE_ESTIMATOR_TYPES.items())
]
"""``algorithm.adv_estimator``: one of the estimators above."""


@dataclass
class AlgorithmConfig:
    adv_estimator: AdvantageEstimator = field(default_factory=GRPO)
    """Advantage estimator and its options: ``GAE()`` (PPO, builds the critic), ``GRPO()`` (the default),
    ``GRPOPassK()``, ``RLOO()``, ``ReinforcePP()``, ``ReinforcePPBaseline()``, ``ReMax()`` (a greedy baseline
    rollout), ``OPO()``, ``GPGAdvantage()``, ``GDPO()`` (several reward components). On the command line:
    ``algorithm.adv-estimator:gae`` picks one, then ``--algorithm.adv-estimator.<option>``."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_ctrl.kl_coef * KL(policy || reference)`` from every response token's reward (InstructGPT-style
    PPO, REINFORCE++). Needs the reference model. Independent of ``actor.use_kl_loss``."""
    kl_penalty: str = "k1"
    """KL estimator for the in-reward penalty: k1 (kl), abs, k2 (mse), k3 (low_var_kl); a '+' form gives the same
    values (verl's names are accepted)."""
    kl_ctrl: KLControl = field(default_factory=FixedKL)
    """Coefficient of the in-reward KL penalty: ``FixedKL()`` (the default) or ``AdaptiveKL()``. On the command line:
    ``algorithm.kl-ctrl:adaptive`` picks one, then ``--algorithm.kl-ctrl.<option>``."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance-sampling correction of the policy loss for the rollout engine's numerics, and its metrics."""


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
    components: list[str] = field(default_factory=list)
    """Further reward functions (``path/to/file.py:fn`` or ``module:fn``, ``reward.function``'s signature), each
    scored on every sample and logged as ``reward/component/<fn>``. They are columns of ``reward_components_BK``
    (after the rule / function score and the reward model's), which GDPO (``algorithm.adv_estimator=GDPO()``)
    normalises one by one; they do not enter ``scores_B``."""
    rule_weight: float = 1.0
    """Weight of the rule / function score. 0 with a reward model: the reward model alone (rule functions are
    not called, so accuracy metrics read 0)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward model (sequence classifier), combined with the rule score."""
    agent_weight: float = 1.0
    """Weight of the agent's rewards in the score (``rollout.agent``: tool reward deltas, the tools' final-state
    scores, interaction rewards): ``score = rule_weight * rule + model.weight * rm + agent_weight * agent``."""
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
    from them (split placement: prompts, samples and weights move between the two meshes with collectives). The
    reference, critic and reward model always live on the actor's ranks."""
    rollout_tp: int = 1
    """Tensor-parallel degree of the rollout engine (consecutive ranks form a TP group)."""
    actor_tp: int = 1
    """Tensor-parallel degree of the FSDP engine's training roles (actor, reference, critic, on the actor's ranks): the
    actor's ranks form a 2-D ``(dp, tp)`` mesh, consecutive ranks a TP group; attention heads and MLP columns/rows are
    sharded over ``tp`` (``torch.distributed.tensor.parallel``), FSDP2 shards over ``dp``. Data stays per rank: a TP
    group runs its members' micro-batches together. Must divide the actor's ranks and the model's attention and KV
    heads; the FSDP engine only (megatron has ``actor.engine.tp``), no ``actor.lora``, and the native rollout
    then keeps its own copy of the weights (synced through the weight stream) instead of reading them in place."""
    actor_ep: int = 1
    """Expert-parallel degree of a mixture-of-experts actor and its reference (FSDP engine): consecutive groups of
    ``actor_ep`` ranks split each MoE layer's experts between them (``E / actor_ep`` each) and send every token to
    its experts' rank with ``all_to_all``; dense parameters stay FSDP2-sharded over all the actor's ranks. Must
    divide the actor's ranks and the model's experts; not with ``actor_tp`` > 1 or ``actor.lora``; the native
    rollout then keeps its own copy of the weights (docs/moe.md)."""


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
    max_staleness: int = 0
    """Asynchronous RL, split placement only (``mesh.rollout_ranks`` apart from the actor's): the rollout ranks
    generate the batch of step t + k while the actor ranks train on step t (k = ``max_staleness``), so a batch is
    trained on with weights up to k updates newer than the ones that generated it. Every sample carries its weight
    version (``weight_version_B``); ``rollout/staleness/*`` logs the distribution. 0: the synchronous loop. With k > 0
    ``algorithm.rollout_correction.mode=auto`` switches the correction on. Not with dynamic sampling
    (``algorithm.filter_groups``) or ReMax, whose extra generation rounds depend on the batch being trained."""
    samples: SampleLogConfig = field(default_factory=SampleLogConfig)
    """The sample log (``samples/train.jsonl``, ``samples/val.jsonl``)."""
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


def picked_fields(cls: type) -> frozenset[str]:
    """The fields of config dataclass ``cls`` that hold a component picked by name: those typed as a union of
    components (``actor.policy_loss``, ``actor.engine``, ``algorithm.adv_estimator``, ``algorithm.kl_ctrl``)."""

    def is_choice(hint) -> bool:
        return typing.get_origin(hint) in (Union, types.UnionType) and any(
            map(dataclasses.is_dataclass, typing.get_args(hint))
        )

    hints = typing.get_type_hints(cls)
    return frozenset(f.name for f in dataclasses.fields(cls) if is_choice(hints[f.name]))


def to_dict(cfg, *, picked: bool = False) -> dict:
    """The config as plain data (the run's ``config.json``, the checkpoint's meta). A component picked by name
    (``picked_fields``) records that name first, so two components with the same options (PPO-clip and CISPO with
    equal clip values) stay told apart."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        out = {"name": cfg.name} if picked else {}
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
    """Stop after this step with a checkpoint, before ``total_steps`` (0: run to the end); ``--resume auto`` continues."""
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
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(save_final=False))
    """Resumable checkpoints under ``output_dir/checkpoints``: the sharded model and optimiser, the LR schedule and the
    data order (``checkpoint.save_every``; on SIGTERM/SIGUSR1 always). ``--resume auto`` (the default) continues from
    the newest one, bit for bit. Off at the end by default (``save_final``): the product is ``output_dir/hf``."""
