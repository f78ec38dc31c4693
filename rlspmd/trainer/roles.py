"""What one rank's step calls (``Roles``): the type the builder (``trainer/build.py``) fills and the loop
(``trainer/rl.py``) reads. It lives apart from both so that neither imports the other's module for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlspmd.rewards.shaping import NoShaping
from rlspmd.roles.base import CriticRole, PolicyRole, ReferenceRole, Stage
from rlspmd.roles.reward import NoReward, Reward
from rlspmd.roles.rollout import RolloutRole
from rlspmd.roles.rollout_correction import ResolvedRolloutCorrection, RolloutCorrectionStage
from rlspmd.roles.teacher import NoTeacher, Teacher, TeacherAdvantage
from rlspmd.stages import StagePoints
from rlspmd.trainer.prompts import NoPrompts, Prompts
from rlspmd.trainer.report import NoReport, StepReport
from rlspmd.trainer.samples import NoSampleLog, SampleLog
from rlspmd.trainer.sampling import DynamicSampling, FollowGreedy, FollowRounds, GreedyBaseline, NoBaseline, SingleRound
from rlspmd.trainer.checkpoint import Checkpointing, NoCheckpointing
from rlspmd.trackers import Trackers


@dataclass
class Roles:
    """Everything one rank's step calls, in the order of the data flow. Every field is set on every rank: what a run
    or a rank does not need is an object that leaves the batch untouched."""

    prompts: Prompts | NoPrompts
    rollout: RolloutRole
    reward: Reward | NoReward
    shaping: Stage | NoShaping
    baseline: GreedyBaseline | FollowGreedy | NoBaseline
    sampling: SingleRound | DynamicSampling | FollowRounds
    ref: ReferenceRole
    teacher: Teacher | NoTeacher
    """The frozen teacher of on-policy distillation: its log-probs of the sampled tokens (``teacher.model_path``)."""
    actor: PolicyRole
    critic: CriticRole
    token_rewards: Stage
    advantage: Stage
    distill: TeacherAdvantage | Stage
    """The teacher's signal on the advantage (``teacher.signal:reverse_kl``); GKD's term is in the actor's loss."""
    correction: RolloutCorrectionStage | Stage
    """Rollout correction of the step's batch when the old log-probs were recomputed (else the loss applies it)."""
    balance: Stage
    report: StepReport | NoReport
    samples: SampleLog | NoSampleLog
    """The sample log (``trainer.samples``): a few samples per step and validation, written by rank 0."""
    trackers: Trackers
    """The experiment trackers of ``trainer.loggers`` (W&B, MLflow, Trackio): rank 0's metric logger starts them."""
    checkpointing: Checkpointing | NoCheckpointing
    data_stats: dict
    """Rank 0's dataset counts, on every rank (``train_prompts``, ``train_dropped``, ``val_prompts``)."""
    resume_from: Path | None
    """The checkpoint to resume from (chosen before any model loads, so a bad one fails in seconds)."""
    attn_kernel: str
    """The training forwards' attention kernel (``model.attn_kernel`` resolved for this device), for the run log."""
    rollout_correction: ResolvedRolloutCorrection
    """``algorithm.rollout_correction`` resolved for this run (its mode and why), for the run log."""
    stages: StagePoints
    """The user's own stages (``trainer.stages``), by point of the step."""
