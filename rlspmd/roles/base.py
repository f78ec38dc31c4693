"""The roles' contracts, and the update loop the trained roles share.

**One stage signature.** Every stage of a step takes the step's ``Batch`` and the step's ``MetricBuffer`` and returns
the ``Batch`` (with the fields it adds); what it measures goes into the buffer, which the trainer reduces once per step.
A role that a run does not need is an object whose stages return the batch untouched (``NoCritic``, ...), so the step
has no branches on what exists. The ``Protocol``s below are the surface the trainer (``trainer/rl.py``) calls; the
builder (``trainer/build.py``) is the one place that decides which implementation stands behind each.

**The update loop** (``ppo_updates``): PPO epochs × mini-batches × micro-batches, one optimiser step per mini-batch.
Loss normalisation is global: before each mini-batch the valid-token and sequence counts are summed over the DP mesh,
every micro-batch loss is divided by those global counts, and gradients are summed over ranks (``engines/fsdp``).
The gradient therefore does not depend on how the mini-batch is split over ranks or micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from rlspmd.algorithms import AGG_MODES, AggArgs, local_denominators
from rlspmd.distributed.dispatch import all_reduce_sum
from rlspmd.engines.base import TrainingEngine, UpdateStats
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.distributed.micro_batches import split_micro_batches


class PolicyRole(Protocol):
    def old_log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        """Adds ``old_logprobs_BR`` (the behaviour policy under the trainer's numerics),
        unless the update provides it."""

    def update(self, batch: Batch, metrics: MetricBuffer) -> Batch: ...


class ReferenceRole(Protocol):
    def log_prob(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        """Adds ``ref_logprobs_BR``."""


class CriticRole(Protocol):
    warmup_steps: int
    """RL steps at the start that update only the critic."""

    def values(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        """Adds ``values_BR``."""

    def update(self, batch: Batch, metrics: MetricBuffer) -> Batch: ...


class Stage(Protocol):
    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch: ...


@dataclass(frozen=True)
class UpdatePlan:
    """How a trained role turns a step's batch into optimiser steps (resolved and checked by the builder)."""

    epochs: int
    local_mini_batch: int
    """Rows of one optimiser step on one DP rank."""
    micro_batch_size: int
    max_tokens: int | None
    """Token budget per micro-batch instead of ``micro_batch_size`` (None: off)."""
    loss_agg_mode: str
    norm_length: int
    """The constant of ``seq-mean-token-sum-norm`` (the response budget)."""
    optim_steps: int
    """Optimiser steps over the whole run (the LR schedule's length)."""
    single_update: bool
    """Exactly one optimiser step per RL step (one epoch over one mini-batch)."""


def update_plan(
    section: str,
    *,
    ppo_epochs: int,
    mini_batch_size: int,
    micro_batch_size: int,
    max_tokens: int | None,
    loss_agg_mode: str,
    samples_per_prompt: int,
    train_batch_size: int,
    dp: int,
    max_response_length: int,
    total_steps: int,
) -> UpdatePlan:
    """Sizes count prompts, as in the config, which ``rlspmd.validate`` checked
    (``section`` names it in the asserts)."""
    rows = mini_batch_size * samples_per_prompt
    assert rows % dp == 0 and train_batch_size % mini_batch_size == 0, (
        section,
        rows,
        dp,
        train_batch_size,
        mini_batch_size,
    )
    assert loss_agg_mode in AGG_MODES, (section, loss_agg_mode)
    per_step = ppo_epochs * (train_batch_size // mini_batch_size)
    return UpdatePlan(
        epochs=ppo_epochs,
        local_mini_batch=rows // dp,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        loss_agg_mode=loss_agg_mode,
        norm_length=max_response_length,
        optim_steps=total_steps * per_step,
        single_update=per_step == 1,
    )


def ppo_updates(
    engine: TrainingEngine,
    batch: Batch,
    loss_fn: Callable[[torch.nn.Module, Batch, AggArgs], torch.Tensor],
    plan: UpdatePlan,
) -> Iterator[UpdateStats]:
    """``plan.epochs`` passes over ``batch``, one optimiser step per mini-batch of ``plan.local_mini_batch`` rows, its
    micro-batches from ``split_micro_batches``. ``loss_fn(module, micro_batch, agg)``; yields each step's stats."""
    mesh = engine.mesh
    for _epoch in range(plan.epochs):
        for mini in batch.split(plan.local_mini_batch):
            counts = all_reduce_sum(torch.stack(local_denominators(mini["loss_mask_BR"])), mesh=mesh)
            agg = AggArgs(
                mode=plan.loss_agg_mode,
                global_tokens=int(counts[0]),
                global_seqs=int(counts[1]),
                norm_length=plan.norm_length,
            )
            micro = split_micro_batches(
                mini, micro_batch_size=plan.micro_batch_size, max_tokens=plan.max_tokens, mesh=mesh
            )
            yield engine.optimizer_step([mb for _, mb in micro], lambda module, mb: loss_fn(module, mb, agg))


def record_updates(
    steps: Iterator[UpdateStats], metrics: MetricBuffer, *, prefix: str, loss_name: str, engine: TrainingEngine
) -> None:
    """Run the update steps and record what every trained role reports: the mean gradient norm over optimiser steps,
    skipped updates, the LR; ``{prefix}/{loss_name}`` gets one count per optimiser step (the loss function records
    the values, normalised globally)."""
    dp = engine.mesh.size()
    for stats in steps:
        metrics.mean(f"{prefix}/grad_norm", stats["grad_norm"] / dp, 1 / dp)
        metrics.sum(f"{prefix}/skipped_updates", stats["skipped"] / dp)
        metrics.mean(f"{prefix}/{loss_name}", 0.0, 1 / dp)  # one global loss per optimiser step
    metrics.max(f"{prefix}/lr", engine.lr)
