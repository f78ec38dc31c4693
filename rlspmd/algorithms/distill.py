"""On-policy distillation: a frozen teacher scores the tokens the student sampled, and its signal trains the student.

The ``teacher`` section (``TeacherConfig``) names the teacher (a causal LM with the student's tokenizer) and picks the
signal, a component of one kind (``DISTILL_SIGNALS``, ``teacher.signal``); which one decides where it acts:

* ``ReverseKL`` (slime's ``--use-opd``, ``opd_kl_coef``; verl's and Thinking Machines' on-policy distillation): the
  per-token reverse KL estimate ``logp_student - logp_teacher`` of each sampled token, times ``kl_coef``, is
  subtracted from the advantage of whatever estimator the run uses, after it ran (``reverse_kl_advantage``). The
  student's log-probs are the old log-probs (the behaviour policy under the trainer's numerics), so they are
  recomputed before the advantage. It acts on the advantage, not as an estimator wrapping another, so it composes with
  every estimator, a user's own included, without nesting one component in another.
* ``GKD`` (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
  arXiv 2306.13649; TRL's ``GKDTrainer.generalized_jsd_loss``): the generalized Jensen-Shannon divergence between
  the student's and the teacher's whole next-token distributions at every model token (``generalized_jsd``), added to
  the policy loss with ``coef``. It needs the teacher's full distribution in the update (``full_vocab``): the teacher
  runs on each update micro-batch and the student's forward computes the divergence chunk by chunk
  (``rlspmd.models.logprobs.chunked_jsd``), which suits a colocated teacher whose ``N x V`` log-probs per micro-batch
  fit in memory.

**Pure distillation** is the advantage estimator ``none`` (``NoAdvantage``: zero advantages, no reward needed): then
the teacher's signal is all the student learns from. Only the model's tokens are scored (``loss_mask_BR``): in
multi-turn rollouts tool results are neither advantaged nor in the divergence.

The pure functions take log-probs and masks (no process groups, no models); the components bind their options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import Tensor

from rlspmd.components import Component, Problem, Registry


@torch.no_grad()
def reverse_kl_advantage(
    advantages_BT: Tensor, student_logprobs_BT: Tensor, teacher_logprobs_BT: Tensor, mask_BT: Tensor, *, coef: float
) -> tuple[Tensor, Tensor]:
    """``A - coef * (logp_student - logp_teacher)`` at the valid tokens (``mask_BT``), ``A`` elsewhere; and the reverse
    KL estimate per token (0 at masked positions). Shapes (B, T); a teacher equal to the student leaves ``A``."""
    valid = mask_BT > 0
    kl = torch.where(valid, student_logprobs_BT - teacher_logprobs_BT, 0.0)
    return torch.where(valid, advantages_BT - coef * kl, advantages_BT), kl


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, *, beta: float = 0.5, temperature: float = 1.0
) -> Tensor:
    """The generalized JSD per position, over the last (vocabulary) dimension; TRL's ``generalized_jsd_loss`` before its
    reduction. With s, t the log-softmax of the logits divided by ``temperature`` and M = (1 - beta) e^s + beta e^t:

        J = beta KL(T || M) + (1 - beta) KL(S || M);   beta = 0: KL(T || S) (forward);   beta = 1: KL(S || T) (reverse).

    Shapes (..., V) -> (...); differentiable in both (the trainer holds the teacher's constant). The reference the
    chunked kernel (``rlspmd.models.logprobs.chunked_jsd``) is tested against."""
    dtype = torch.promote_types(torch.promote_types(student_logits.dtype, teacher_logits.dtype), torch.float32)
    s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


# -- the signal: one component kind ----------------------------------------------------------------------------------

DISTILL_SIGNALS = Registry("distillation signal")
"""Every distillation signal by its name (``teacher.signal:NAME``)."""


@dataclass(frozen=True)
class JSDTerm:
    """GKD's loss term, bound: ``coef * agg(JSD_beta at temperature)`` over the model's tokens."""

    coef: float
    beta: float
    temperature: float


class DistillSignal(Component):
    """``teacher.signal``: how the teacher's scores train the student. ``at``: where it acts, ``advantage`` (after the
    estimator, from the teacher's log-probs of the sampled tokens) or ``loss`` (a term of the policy loss);
    ``full_vocab``: it needs the teacher's whole distribution at every token during the update (the teacher then
    runs in each update micro-batch; engines with ``vocab_outputs``)."""

    registry = DISTILL_SIGNALS
    at: ClassVar[Literal["advantage", "loss"]] = "advantage"
    full_vocab: ClassVar[bool] = False

    def build(self):
        """``advantage``: ``fn(advantages_BT, student_logprobs_BT, teacher_logprobs_BT, mask_BT) -> (advantages_BT,
        kl_BT)``; ``loss``: a ``JSDTerm``."""
        raise NotImplementedError


@dataclass
class ReverseKL(DistillSignal):
    """The advantage minus ``kl_coef`` times the per-token reverse KL ``logp_student - logp_teacher`` (slime's
    ``--use-opd``), on top of any estimator; with ``algorithm.adv-estimator:none`` it is the whole advantage."""

    name: ClassVar[str] = "reverse_kl"
    kl_coef: float = 1.0
    """Weight of the reverse KL in the advantage (slime's ``opd_kl_coef``, > 0)."""

    def problems(self) -> list[Problem]:
        return [] if self.kl_coef > 0 else [("kl_coef", self.kl_coef, "must be > 0")]

    def build(self):
        def shape(advantages_BT, student_logprobs_BT, teacher_logprobs_BT, mask_BT):
            return reverse_kl_advantage(
                advantages_BT, student_logprobs_BT, teacher_logprobs_BT, mask_BT, coef=self.kl_coef
            )

        return shape


@dataclass
class GKD(DistillSignal):
    """GKD: ``coef`` times the generalized JSD between the student's and the teacher's next-token distributions over the
    whole vocabulary at every model token, added to the policy loss (TRL's ``generalized_jsd_loss``). The teacher runs
    in every update micro-batch (colocated; FSDP engine)."""

    name: ClassVar[str] = "gkd"
    at: ClassVar[Literal["advantage", "loss"]] = "loss"
    full_vocab: ClassVar[bool] = True
    beta: float = 0.5
    """Interpolation of the JSD in [0, 1]: 0 is KL(teacher || student), 1 is KL(student || teacher)."""
    temperature: float = 1.0
    """Softmax temperature of both distributions in the divergence (> 0; TRL's ``temperature``)."""
    coef: float = 1.0
    """Weight of the divergence in the loss (> 0)."""

    def problems(self) -> list[Problem]:
        out = [] if 0 <= self.beta <= 1 else [("beta", self.beta, "must be in [0, 1]")]
        out += [(n, v, "must be > 0") for n, v in (("temperature", self.temperature), ("coef", self.coef)) if v <= 0]
        return out

    def build(self):
        return JSDTerm(coef=self.coef, beta=self.beta, temperature=self.temperature)


SignalChoice = DISTILL_SIGNALS.choice()


# -- the section ------------------------------------------------------------------------------------------------------


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation: a frozen causal LM on the actor's ranks and engine (loaded like the
    reference: sharded, meta-device, its own copy), and the signal it trains the student with."""

    model_path: str | None = None
    """Teacher model directory; None: no teacher. Any size, but the student's tokenizer: the same vocabulary (checked
    with the other files before anything loads; a teacher with another tokenizer is an error naming both)."""
    signal: SignalChoice = field(default_factory=ReverseKL)
    """How the teacher trains the student: ``ReverseKL(kl_coef)`` (the default: on the advantage) or ``GKD(beta,
    temperature, coef)`` (a JSD term of the loss). Command line: ``teacher.signal:gkd --teacher.signal.beta 1``."""
    logprob_micro_batch_size: int = 16
    """Sequences per teacher forward on one rank (its log-probs of the sampled tokens)."""
    logprob_max_tokens_per_micro_batch: int | None = None
    """Dynamic batching for the teacher forward: at most this many valid tokens per micro-batch. None: off."""
    offload: bool = False
    """Keep the teacher's sharded parameters in host memory between uses (as ``ref.offload``; CUDA only). Not with
    ``gkd``, whose teacher runs in every update micro-batch."""

    @property
    def enabled(self) -> bool:
        return self.model_path is not None

    def problems(self) -> list[Problem]:
        out: list[Problem] = []
        if self.logprob_micro_batch_size < 1:
            out.append(("logprob_micro_batch_size", self.logprob_micro_batch_size, "must be >= 1"))
        if self.logprob_max_tokens_per_micro_batch is not None and self.logprob_max_tokens_per_micro_batch < 1:
            out.append(
                ("logprob_max_tokens_per_micro_batch", self.logprob_max_tokens_per_micro_batch, "must be >= 1, or None")
            )
        if self.offload and self.signal.full_vocab:
            why = f"does not combine with {self.signal.name}, whose teacher runs in every update micro-batch"
            out.append(("offload", self.offload, why))
        return out


def teacher_run_problems(
    teacher: TeacherConfig,
    *,
    uses_reward: bool,
    estimator: str,
    vocab_outputs: bool,
    engine: str,
    actor_tp: int,
    filter_groups: bool,
) -> list[Problem]:
    """What the teacher and the estimator need from the rest of the run (fields named from the config's root):
    pure distillation needs a teacher and no dynamic sampling; a full-vocabulary signal needs an engine whose policy
    module returns vocabulary outputs and one tensor-parallel rank per sample."""
    out: list[Problem] = []
    if not uses_reward and not teacher.enabled:
        out.append(
            (
                "algorithm.adv_estimator",
                estimator,
                "learns from no reward: give a teacher (teacher.model_path) whose signal trains the student",
            )
        )
    if not uses_reward and filter_groups:
        out.append(
            ("algorithm.filter_groups.enable", True, f"keeps groups whose rewards vary; {estimator} reads no reward")
        )
    if teacher.enabled and teacher.signal.full_vocab:
        if not vocab_outputs:
            out.append(
                (
                    "teacher.signal",
                    teacher.signal.name,
                    f"needs the full vocabulary in the update, which actor.engine:{engine} does not compute; use fsdp",
                )
            )
        if actor_tp > 1:
            out.append(
                (
                    "mesh.actor_tp",
                    actor_tp,
                    f"teacher.signal:{teacher.signal.name} scores each rank's own tokens: use actor_tp=1",
                )
            )
    return out


__all__ = [
    "DISTILL_SIGNALS",
    "GKD",
    "DistillSignal",
    "JSDTerm",
    "ReverseKL",
    "TeacherConfig",
    "generalized_jsd",
    "reverse_kl_advantage",
    "teacher_run_problems",
]
