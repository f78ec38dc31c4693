"""RLOO (Ahmadian et al. 2024, arXiv 2402.14740): REINFORCE with a leave-one-out baseline, no critic.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/rloo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/rloo.py:cpu   # CPU: the quickstart's tiny model

Each sample's baseline is the mean score of the other samples of its prompt. The KL to the reference is a
per-token penalty in the reward (as in the paper), so it enters the sequence reward the baseline is taken over.
GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir data/gsm8k``.

GRPO's recipe (``configs/grpo.py``, whose ``MODEL`` line picks the model) with this estimator, the KL in the
reward instead of the loss.
"""

from pathlib import Path

from rlspmd.config import RLOO, AlgorithmConfig, Config, FixedKL, load_config_file

GRPO = Path(__file__).with_name("grpo.py")  # the base recipe: its MODEL line picks the model
ALGORITHM = AlgorithmConfig(
    adv_estimator=RLOO(), use_kl_in_reward=True, kl_penalty="k1", kl_ctrl=FixedKL(kl_coef=0.001)
)


def rloo(cfg: Config, *, output_dir: str) -> Config:
    cfg.actor.loss_agg_mode = "token-mean"
    cfg.actor.use_kl_loss = False  # the KL lives in the reward
    cfg.algorithm = ALGORITHM
    cfg.trainer.output_dir = output_dir
    return cfg


config = rloo(load_config_file(GRPO), output_dir="outputs/rloo-gsm8k")


def cpu() -> Config:
    """RLOO on the quickstart (``configs/grpo.py:cpu``): the tiny model's SFT warm start, arithmetic, 2 CPU ranks."""
    return rloo(load_config_file(f"{GRPO}:cpu"), output_dir="outputs/rloo-cpu")
