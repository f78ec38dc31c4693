"""The teacher of on-policy distillation (``teacher`` section, ``rlspmd/algorithms/distill.py``) and where its signal
enters the step.

* ``Teacher.log_prob`` (the step's ``teacher`` stage, next to the reference's): the frozen teacher's log-probs of the
  sampled tokens, ``teacher_logprobs_BR``, and the share of the model's tokens where the student sampled the teacher's
  most probable token (``teacher/argmax_share``). It runs on the actor's engine and layout, like the reference.
* ``TeacherAdvantage`` (``teacher.signal:reverse_kl``, after the estimator): the advantage minus ``kl_coef`` times the
  per-token reverse KL against the old log-probs; logs ``teacher/kl``, the mean of ``logp_student - logp_teacher``
  over the model's tokens (a k1 estimate of KL(student || teacher) per token).
* ``TeacherLossTerm`` (``teacher.signal:gkd``): in every update micro-batch the teacher's log-probs over the whole
  vocabulary, and the student's forward turns them into GKD's JSD (``rlspmd.models.policy``), added to the policy loss
  with the loss's aggregation; logs ``teacher/jsd`` and ``teacher/kl`` (the update's log-probs).

``NoTeacher`` (and the policy's ``NoLossTerm``) stand in where a run has no teacher. Only ``loss_mask_BR`` tokens are
scored: tool results and template glue of multi-turn responses are neither in the advantage shift nor in the divergence.
"""

from __future__ import annotations

import warnings

import torch

from rlspmd.algorithms import AggArgs
from rlspmd.algorithms.distill import JSDTerm, TeacherConfig
from rlspmd.engines.base import TrainingEngine
from rlspmd.metrics import MetricBuffer
from rlspmd.models.logprobs import ARGMAX, VOCAB_LOGPROBS, JSDTarget
from rlspmd.protocol import Batch
from rlspmd.roles.policy import compute_logprobs


class Teacher:
    """Frozen teacher; adds ``teacher_logprobs_BR``."""

    def __init__(
        self, cfg: TeacherConfig, *, engine: TrainingEngine, temperature: float, offload: bool, argmax: bool = True
    ):
        """``offload``: keep the parameters in host memory between uses (the builder resolved ``teacher.offload``).
        ``argmax``: the engine's module gives the kernel's per-token extras (``vocab_outputs``), so the step also logs
        ``teacher/argmax_share``."""
        self.cfg, self.engine = cfg, engine
        self.temperature = temperature
        self.offload = offload
        self.extras = (ARGMAX,) if argmax else ()
        if offload:
            self.engine.offload_params()

    def log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        if self.offload:
            self.engine.load_params()
        lp, _, *argmax = compute_logprobs(
            self.engine.module,
            batch,
            micro_batch_size=self.cfg.logprob_micro_batch_size,
            temperature=self.temperature,
            max_tokens=self.cfg.logprob_max_tokens_per_micro_batch,
            mesh=self.engine.mesh,
            extras=self.extras,
        )
        if self.offload:
            self.engine.offload_params()
        mask = batch["loss_mask_BR"].float()
        for share in argmax:  # the sampled token is the teacher's most probable one
            metrics.mean("teacher/argmax_share", (share * mask).sum(), mask.sum())
        return batch.set(teacher_logprobs_BR=lp)

    @torch.no_grad()
    def vocab_logprobs(self, mb: Batch, *, temperature: float) -> torch.Tensor:
        """``(N, V)``: the teacher's log-probs over the vocabulary at the response positions of micro-batch ``mb``, in
        the order a student with the same packing setting scores them (``rlspmd.models.policy``)."""
        _, _, out = self.engine.module(
            mb["input_ids_BL"],
            mb["attention_mask_BL"],
            mb["position_ids_BL"],
            response_len=mb["responses_BR"].shape[1],
            temperature=temperature,
            with_entropy=False,
            extras=(VOCAB_LOGPROBS,),
        )
        return out[VOCAB_LOGPROBS]


class NoTeacher:
    """Stands in when the run has no teacher: does nothing."""

    def log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch


class TeacherAdvantage:
    """``teacher.signal:reverse_kl``: shifts ``advantages_BR`` by the teacher's reverse KL (after the estimator)."""

    def __init__(self, shape):
        """``shape``: the signal's bound function (``ReverseKL.build()``)."""
        self.shape = shape

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        mask = batch["loss_mask_BR"].float()
        adv, kl = self.shape(batch["advantages_BR"], batch["old_logprobs_BR"], batch["teacher_logprobs_BR"], mask)
        metrics.mean("teacher/kl", kl.sum(), mask.sum())
        return batch.set(advantages_BR=adv)


class TeacherLossTerm:
    """``teacher.signal:gkd``: ``coef * agg(JSD)`` over the model's tokens, the teacher's distribution computed per
    update micro-batch."""

    def __init__(self, term: JSDTerm, *, teacher: Teacher):
        self.term, self.teacher = term, teacher

    def inputs(self, mb: Batch) -> dict:
        """What the student's forward needs on ``mb``: the teacher's distribution as a JSD target."""
        t = self.term
        target = self.teacher.vocab_logprobs(mb, temperature=t.temperature)
        return {"jsd": JSDTarget(target, beta=t.beta, temperature=t.temperature)}

    def add(
        self, loss: torch.Tensor, outputs: dict, logp_BR: torch.Tensor, mb: Batch, *, agg: AggArgs, metrics
    ) -> torch.Tensor:
        mask = mb["loss_mask_BR"].float()
        jsd = outputs["jsd"]
        n_tok = mask.sum()
        metrics.mean("teacher/jsd", (jsd.detach() * mask).sum(), n_tok)
        metrics.mean("teacher/kl", ((logp_BR.detach() - mb["teacher_logprobs_BR"]) * mask).sum(), n_tok)
        return loss + self.term.coef * agg(jsd, mask)


def resolve_teacher_offload(cfg: TeacherConfig, *, device: torch.device, cpu_offload: bool) -> bool:
    """``teacher.offload`` where it does something: on CUDA, unless FSDP already keeps the parameters on the host."""
    if cfg.offload and (device.type != "cuda" or cpu_offload):
        warnings.warn(
            "teacher.offload does nothing here: the teacher's parameters already live in host memory "
            f"(device {device.type}, actor.engine.cpu_offload={cpu_offload})",
            stacklevel=2,
        )
        return False
    return cfg.offload
