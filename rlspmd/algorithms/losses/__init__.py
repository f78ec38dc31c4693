"""Policy and value losses: pure functions from log-probabilities and advantages to a scalar loss and metrics, each
policy loss beside its config component (``PolicyLoss``; the contract every loss shares is in ``common.py``).

* ``ppo.py``: PPO-clip (with dual clip), CISPO, GPG, DRO;
* ``dppo.py``: DPPO's binary-TV and binary-KL trust regions;
* ``sequence.py``: GSPO, SAPO, GMPO (per-sequence objectives);
* ``covariance.py``: Clip-Cov, KL-Cov (token selection by covariance, per micro-batch);
* ``value.py``: the critic's value loss and the entropy bonus.

Importing this package registers every built-in policy loss in ``POLICY_LOSSES``. A loss added to rlspmd is a module
here and its import below; a user's loss is a ``PolicyLoss`` subclass in their own file (docs/extending.md).
"""

# registered in this order: the order --help and error messages list them in
from rlspmd.algorithms.losses.common import POLICY_LOSSES, LossFn, PolicyLoss
from rlspmd.algorithms.losses.ppo import CISPO, DRO, GPG, PPOClip, cispo, dro, gpg_loss, ppo_clip
from rlspmd.algorithms.losses.sequence import GMPO, GSPO, SAPO, gmpo, gspo, sapo
from rlspmd.algorithms.losses.covariance import ClipCov, KLCov, clip_cov, kl_cov  # noqa: E402,I001
from rlspmd.algorithms.losses.dppo import DPPOKL, DPPOTV, dppo_kl, dppo_tv  # noqa: E402,I001
from rlspmd.algorithms.losses.value import entropy_bonus, value_loss

__all__ = [
    "CISPO",
    "DPPOKL",
    "DPPOTV",
    "DRO",
    "GMPO",
    "GPG",
    "GSPO",
    "POLICY_LOSSES",
    "SAPO",
    "ClipCov",
    "KLCov",
    "LossFn",
    "PPOClip",
    "PolicyLoss",
    "cispo",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "entropy_bonus",
    "gmpo",
    "gpg_loss",
    "gspo",
    "kl_cov",
    "ppo_clip",
    "sapo",
    "value_loss",
]
