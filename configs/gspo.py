"""GSPO (Zheng et al. 2025, arXiv 2507.18071): GRPO's advantages with a sequence-level importance ratio.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/gspo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/gspo.py:cpu   # CPU: the quickstart's tiny model

The ratio is the geometric mean of the token ratios of a sequence and whole sequences are clipped, with the
paper's tiny clip range (3e-4 / 4e-4). Several mini-batches per step make the later ones off-policy, which is
where the sequence ratio matters. GRPO's recipe (``configs/grpo.py``, whose ``MODEL`` line picks the model) with the
loss changed. Other policy losses are one field away: ``actor.policy_loss`` holds
``PPOClip()``, ``GSPO()``, ``CISPO()``, ``SAPO(tau_pos=..., tau_neg=...)``, ``GPG()`` or ``GMPO()`` (on the command line
``actor.policy-loss:sapo --actor.policy-loss.tau-neg 1.1``). GSM8K: ``python scripts/data/gsm8k.py
--input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import GSPO, Config, load_config_file

GRPO = Path(__file__).with_name("grpo.py")  # the base recipe: its MODEL line picks the model


def gspo(cfg: Config, *, output_dir: str) -> Config:
    a = cfg.actor
    a.policy_loss = GSPO(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    a.loss_agg_mode = "seq-mean-token-mean"
    a.use_kl_loss = False
    cfg.trainer.output_dir = output_dir
    return cfg


config = gspo(load_config_file(GRPO), output_dir="outputs/gspo-gsm8k")
config.actor.mini_batch_size = 32  # 8 optimiser steps per RL step


def cpu() -> Config:
    """GSPO on the quickstart (``configs/grpo.py:cpu``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = gspo(load_config_file(f"{GRPO}:cpu"), output_dir="outputs/gspo-cpu")
    cfg.actor.mini_batch_size = cfg.data.train_batch_size // 2  # two optimiser steps: the second is off-policy
    return cfg
