"""The algorithm library: advantage estimators, policy / value losses, KL control and loss aggregation.

Pure tensor functions only: no process groups, no config objects, no I/O. Shapes are in the names (`_B` per
sequence, `_BT` per response token) and `mask_BT` is 1.0 for response tokens that count, 0.0 for padding and for
tool / observation tokens. Where a quantity must be global (loss denominators, whitening statistics, GPG's alpha)
the function takes it as an argument and the trainer does the one all-reduce that produces it (`estimators.py`
applies the advantage estimators to a batch, with that all-reduce handed in as a function).

Policy losses, advantage estimators and KL controllers are picked by their config components, each beside its code
and registered in its kind's registry (`POLICY_LOSSES`, `ADVANTAGE_ESTIMATORS`, `KL_CONTROLS`); a config string
selects a KL estimator or an aggregation through `KL_ESTIMATORS`, `AGG_MODES`. Rollout correction (importance weights
pi_train / pi_rollout, truncation and rejection, mismatch metrics) is in `rollout_correction.py`; its weights and
mask go into any policy loss through `weights_BT` / `mask_BT`. On-policy distillation's signals (a teacher's reverse KL
on the advantage, GKD's JSD) and the teacher section are in `distill.py`; the optimal token baseline in `otb.py`.
"""

from rlspmd.algorithms.advantages import (
    gae,
    gdpo,
    gdpo_combine,
    gpg,
    gpg_alpha,
    grpo_outcome,
    grpo_passk,
    masked_moments,
    masked_whiten,
    opo,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
    rloo,
    token_level_scores,
    zero_variance_rows,
)
from rlspmd.algorithms.otb import optimal_token_baseline
from rlspmd.algorithms.aggregation import AGG_MODES, AggArgs, agg_loss, local_denominators
from rlspmd.algorithms.distill import (
    DISTILL_SIGNALS,
    GKD,
    DistillSignal,
    ReverseKL,
    TeacherConfig,
    generalized_jsd,
    reverse_kl_advantage,
)
from rlspmd.algorithms.estimators import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from rlspmd.algorithms.kl import (
    KL_CONTROLS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLControl,
    apply_kl_in_reward,
    kl_penalty,
    sample_mean_kl,
)
from rlspmd.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLoss,
    cispo,
    clip_cov,
    dppo_kl,
    dppo_tv,
    dro,
    entropy_bonus,
    gmpo,
    gpg_loss,
    gspo,
    kl_cov,
    ppo_clip,
    sapo,
    value_loss,
)
from rlspmd.algorithms.rollout_correction import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    RolloutCorrection,
    rollout_correction,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "DISTILL_SIGNALS",
    "DistillSignal",
    "GKD",
    "ReverseKL",
    "TeacherConfig",
    "KL_CONTROLS",
    "AdvantageEstimator",
    "KLControl",
    "PolicyLoss",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AggArgs",
    "FixedKLController",
    "RolloutCorrection",
    "agg_loss",
    "apply_kl_in_reward",
    "cispo",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "entropy_bonus",
    "gae",
    "gdpo",
    "gdpo_combine",
    "generalized_jsd",
    "gmpo",
    "gpg",
    "gpg_alpha",
    "gpg_loss",
    "grpo_outcome",
    "grpo_passk",
    "gspo",
    "kl_cov",
    "kl_penalty",
    "local_denominators",
    "masked_moments",
    "masked_whiten",
    "opo",
    "optimal_token_baseline",
    "ppo_clip",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "reverse_kl_advantage",
    "rloo",
    "rollout_correction",
    "sample_mean_kl",
    "sapo",
    "token_level_scores",
    "value_loss",
    "zero_variance_rows",
]
