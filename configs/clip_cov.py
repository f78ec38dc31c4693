"""Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO's clipped loss, plus the gradient of a few high-covariance
tokens removed, so that entropy does not collapse.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/clip_cov.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/clip_cov.py:cpu   # CPU: the quickstart's tiny model

Entropy falls when the policy raises tokens that are both likely and advantageous; the paper measures that with
the covariance (A_t - mean A)(logp_t - mean logp) and, in each micro-batch, draws ``actor.policy_loss.clip_cov_ratio``
of the tokens whose covariance lies in (``clip_cov_lb``, ``clip_cov_ub``) and detaches them. The paper's
settings (and verl's defaults): ratio 2e-4, band (1, 5), token-level loss, no KL term. KL-Cov, the other
estimator of the paper, is ``configs/kl_cov.py``; both are GRPO's recipe (``configs/grpo.py``, whose ``MODEL`` line
picks the model) with the loss changed. GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir
data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import ClipCov, Config, load_config_file

GRPO = Path(__file__).with_name("grpo.py")  # the base recipe: its MODEL line picks the model


def clip_cov(cfg: Config, *, output_dir: str) -> Config:
    a = cfg.actor
    a.policy_loss = ClipCov(
        clip_ratio_low=0.2, clip_ratio_high=0.2, clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0
    )
    a.loss_agg_mode = "token-mean"
    a.use_kl_loss = False
    cfg.trainer.output_dir = output_dir
    return cfg


config = clip_cov(load_config_file(GRPO), output_dir="outputs/clip-cov-gsm8k")
config.actor.mini_batch_size = 32  # 8 optimiser steps per RL step


def cpu() -> Config:
    """Clip-Cov on the quickstart (``configs/grpo.py:cpu``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = clip_cov(load_config_file(f"{GRPO}:cpu"), output_dir="outputs/clip-cov-cpu")
    cfg.actor.policy_loss.clip_cov_ratio = (
        2e-3  # micro-batches of ~1-2k tokens: a few tokens each instead of the minimum one
    )
    return cfg
