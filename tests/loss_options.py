"""The policy losses with the options the shared-behaviour tests use, bound through their config components."""

import torch

from rlspmd.config import CISPO, DPPOKL, DPPOTV, DRO, GMPO, GPG, GSPO, SAPO, ClipCov, KLCov, PPOClip


def components(
    *, clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float, kl_cov_ratio: float, kl_cov_coef: float = 0.1
) -> dict:
    """Every policy loss by name, each clipped one with the range (0.2, 0.28)."""
    return {
        "ppo_clip": PPOClip(0.2, 0.28, 3.0),
        "gspo": GSPO(0.2, 0.28),
        "cispo": CISPO(0.2, 0.28),
        "sapo": SAPO(1.0, 1.05),
        "gpg": GPG(),
        "gmpo": GMPO(0.2, 0.28),
        "clip_cov": ClipCov(0.2, 0.28, clip_cov_ratio, clip_cov_lb, clip_cov_ub),
        "kl_cov": KLCov(kl_cov_ratio, kl_cov_coef),
        "dppo_tv": DPPOTV(0.15, 0.15, 20.0),
        "dppo_kl": DPPOKL(0.05, 0.05, 20.0),
        "dro": DRO(0.1),
    }


def bound(component):
    """The loss with its options bound and a fresh seeded generator, so Clip-Cov draws the same tokens on every call."""
    return component.build(generator=torch.Generator().manual_seed(0))
