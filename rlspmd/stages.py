"""A user's own stage of the RL step: a component that runs at a named point of every step, on each actor rank's
batch (``trainer.stages``).

The step (``rlspmd/trainer/rl.py``) offers two points: ``scored``, once a step's samples are generated and scored
(after dynamic sampling, before the reference and old log-probs: reshape or filter rewards, add a per-sample
column), and ``advantaged``, once the advantages are computed (before the rollout correction, balancing and the
updates: reshape advantages). A stage is ``(batch, metrics) -> batch`` on this rank's rows: group statistics are
local (a prompt's samples live on one rank), and what must be global is reduced over ``mesh`` (the actor's DP mesh),
with the same collectives on every rank. Metrics added to ``metrics`` are reduced over the ranks and logged with the
step's. Defining a ``StepStage`` subclass registers it in ``STEP_STAGES``; docs/extending.md has an example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Literal

from rlspmd.components import Component, Registry
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch

StagePoint = Literal["scored", "advantaged"]
StageFn = Callable[[Batch, MetricBuffer], Batch]

STEP_STAGES = Registry("step stage")
"""Every step stage by its name (rlspmd ships none: its own stages are written into the step)."""


class StepStage(Component):
    """``trainer.stages``: a stage with its options (the dataclass fields of a subclass), run at ``at``."""

    registry = STEP_STAGES
    at: ClassVar[StagePoint]

    def build(self, *, mesh, tokenizer) -> StageFn:
        """The stage: ``mesh`` is the actor's DP mesh (``None`` on one rank is never passed: a mesh of one),
        ``tokenizer`` the run's (decode responses, render prompts)."""
        raise NotImplementedError


class StagePoints:
    """The user stages of a run, by point; a point without stages returns the batch untouched."""

    def __init__(self, stages: dict[StagePoint, list[StageFn]] | None = None):
        self.stages = stages or {}

    def __call__(self, point: StagePoint, batch: Batch, metrics: MetricBuffer) -> Batch:
        for stage in self.stages.get(point, ()):
            batch = stage(batch, metrics)
        return batch
