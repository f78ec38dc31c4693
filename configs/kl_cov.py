"""KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped policy-gradient loss, plus a KL penalty on the tokens of
largest advantage-logprob covariance, so that entropy does not collapse.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/kl_cov.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/kl_cov.py:cpu   # CPU: the quickstart's tiny model

In each micro-batch the ``actor.policy_loss.kl_cov_ratio`` share of tokens with the largest covariance (A_t - mean
A)(logp_t - mean logp) get ``kl_cov_coef * |logp - old_logp|`` added to their loss; no token is clipped. The paper's 7B
recipe: ratio 2e-3, coefficient 1 (32B: ratio 2e-4); token-level loss, no KL-to-reference term. Several
mini-batches per step make the penalty act (at the first one logp = old_logp). Clip-Cov is ``configs/clip_cov.py``. Both
are GRPO's recipe (``configs/grpo.py``, whose ``MODEL`` line picks the model) with the loss changed.
GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import Config, KLCov, load_config_file

GRPO = Path(__file__).with_name("grpo.py")  # the base recipe: its MODEL line picks the model


def kl_cov(cfg: Config, *, output_dir: str) -> Config:
    a = cfg.actor
    a.policy_loss = KLCov(kl_cov_ratio=2e-3, kl_cov_coef=1.0)
    a.loss_agg_mode = "token-mean"
    a.use_kl_loss = False
    cfg.trainer.output_dir = output_dir
    return cfg


config = kl_cov(load_config_file(GRPO), output_dir="outputs/kl-cov-gsm8k")
config.actor.mini_batch_size = 32  # 8 optimiser steps per RL step


def cpu() -> Config:
    """KL-Cov on the quickstart (``configs/grpo.py:cpu``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = kl_cov(load_config_file(f"{GRPO}:cpu"), output_dir="outputs/kl-cov-cpu")
    cfg.actor.mini_batch_size = cfg.data.train_batch_size // 2  # two optimiser steps: the second is off-policy
    return cfg
