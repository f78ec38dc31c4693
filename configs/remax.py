"""ReMax (Li et al. 2023, arXiv 2310.10505): REINFORCE with the score of the greedy response as the baseline.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/remax.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/remax.py:cpu   # CPU: the quickstart's tiny model

Every prompt gets one extra greedy generation, scored like the samples, in the rollout stage; the advantage of a
sample is its score minus that baseline. No critic, no group needed (one sample per prompt). KL to the
reference as a per-token penalty in the reward. GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir
data/gsm8k``.

GRPO's recipe (``configs/grpo.py``, whose ``MODEL`` line picks the model) with this estimator, the KL in the
reward instead of the loss, and its own batch sizes.
"""

from pathlib import Path

from rlspmd.config import AlgorithmConfig, Config, FixedKL, ReMax, load_config_file

GRPO = Path(__file__).with_name("grpo.py")  # the base recipe: its MODEL line picks the model
ALGORITHM = AlgorithmConfig(
    adv_estimator=ReMax(), use_kl_in_reward=True, kl_penalty="k1", kl_ctrl=FixedKL(kl_coef=0.001)
)


def remax(cfg: Config, *, output_dir: str) -> Config:
    cfg.actor.loss_agg_mode = "token-mean"
    cfg.actor.use_kl_loss = False  # the KL lives in the reward
    cfg.algorithm = ALGORITHM
    cfg.trainer.output_dir = output_dir
    return cfg


config = remax(load_config_file(GRPO), output_dir="outputs/remax-gsm8k")
config.actor.mini_batch_size = 128
config.rollout.n = 1  # the greedy baseline replaces the group
config.data.train_batch_size = 512
config.trainer.total_steps = 200


def cpu() -> Config:
    """ReMax on the quickstart (``configs/grpo.py:cpu``): the tiny model's SFT warm start, arithmetic, 2 CPU ranks."""
    cfg = remax(load_config_file(f"{GRPO}:cpu"), output_dir="outputs/remax-cpu")
    cfg.rollout.n = 4
    return cfg
