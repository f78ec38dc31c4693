"""The algorithm library: advantage estimators, policy / value losses, KL control and loss aggregation.

Pure tensor functions only: no process groups, no config objects, no I/O. Shapes are in the names (`_B` per
sequence, `_BT` per response token) and `mask_BT` is 1.0 for response tokens that count, 0.0 for padding and for
tool / observation tokens. Where a quantity must be global (loss denominators, whitening statistics, GPG's alpha)
the function takes it as an argument and the trainer does the one all-reduce that produces it.

A config string selects an implementation through the registries:
`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`, `KL_ESTIMATORS`, `AGG_MODES`.
"""

from rlspmd.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    gae,
    gpg,
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
from rlspmd.algorithms.aggregation import AGG_MODES, AggArgs, agg_loss, local_denominators
from rlspmd.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_penalty,
)
from rlspmd.algorithms.losses import (
    POLICY_LOSS_OPTIONS,
    POLICY_LOSSES,
    cispo,
    entropy_bonus,
    gmpo,
    gpg_loss,
    gspo,
    ppo_clip,
    sapo,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_OPTIONS",
    "AdaptiveKLController",
    "AggArgs",
    "FixedKLController",
    "agg_loss",
    "apply_kl_in_reward",
    "cispo",
    "entropy_bonus",
    "gae",
    "gmpo",
    "gpg",
    "gpg_loss",
    "grpo_outcome",
    "grpo_passk",
    "gspo",
    "kl_penalty",
    "local_denominators",
    "masked_moments",
    "masked_whiten",
    "opo",
    "ppo_clip",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "sapo",
    "token_level_scores",
    "value_loss",
    "zero_variance_rows",
]
