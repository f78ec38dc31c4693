"""GSPO (Zheng et al. 2025, arXiv 2507.18071): GRPO's advantages with a sequence-level importance ratio.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/gspo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/gspo.py:cpu   # CPU: the quickstart's tiny model

The ratio is the geometric mean of the token ratios of a sequence and whole sequences are clipped, with the
paper's tiny clip range (3e-4 / 4e-4). Several mini-batches per step make the later ones off-policy, which is
where the sequence ratio matters. GRPO's recipe (``configs/grpo.py``, whose ``MODEL`` line picks the model) with the
loss changed. Other policy losses are one field away: ``actor.policy_loss`` in ppo_clip,
gspo, cispo, sapo (``actor.sapo_tau_pos`` / ``sapo_tau_neg``), gpg, gmpo. GSM8K: ``python scripts/data/gsm8k.py
--input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import Config, load_config_file

GRPO = Path(__file__).with_name("grpo.py")  # the base recipe: its MODEL line picks the model


def gspo(cfg: Config, *, output_dir: str) -> Config:
    a = cfg.actor
    a.policy_loss = "gspo"
    a.clip_ratio_low, a.clip_ratio_high = 3e-4, 4e-4
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
