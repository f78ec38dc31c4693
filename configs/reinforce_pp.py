"""REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted return-to-go of KL-penalised token rewards, whitened
over the global batch; no critic, no group baseline.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/reinforce_pp.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/reinforce_pp.py:cpu   # CPU: the quickstart's model

REINFORCE++-baseline (the group-mean baseline variant for several samples per prompt) is
``algorithm.adv-estimator:reinforce-pp-baseline``. Whitening statistics are all-reduced over the DP ranks, so
advantages do not depend on how many ranks there are. GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k
--out-dir data/gsm8k``.

GRPO's recipe (``configs/grpo.py``, whose ``MODEL`` line picks the model) with this estimator, the KL in the
reward instead of the loss, and its own batch sizes.
"""

from pathlib import Path

from rlspmd.config import AlgorithmConfig, Config, FixedKL, ReinforcePP, load_config_file

GRPO = Path(__file__).with_name("grpo.py")  # the base recipe: its MODEL line picks the model
ALGORITHM = AlgorithmConfig(
    adv_estimator=ReinforcePP(gamma=1.0), use_kl_in_reward=True, kl_penalty="k2", kl_ctrl=FixedKL(kl_coef=0.001)
)


def reinforce_pp(cfg: Config, *, output_dir: str) -> Config:
    cfg.actor.loss_agg_mode = "token-mean"
    cfg.actor.use_kl_loss = False  # the KL lives in the reward
    cfg.algorithm = ALGORITHM
    cfg.trainer.output_dir = output_dir
    return cfg


config = reinforce_pp(load_config_file(GRPO), output_dir="outputs/reinforce_pp-gsm8k")
config.actor.mini_batch_size = 128
config.rollout.n = 4
config.data.train_batch_size = 512
config.trainer.total_steps = 200


def cpu() -> Config:
    """REINFORCE++ on the quickstart (``configs/grpo.py:cpu``): the tiny model's SFT warm start,
    arithmetic, 2 CPU ranks."""
    return reinforce_pp(load_config_file(f"{GRPO}:cpu"), output_dir="outputs/reinforce_pp-cpu")
