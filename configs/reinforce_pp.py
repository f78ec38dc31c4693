"""REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted return-to-go of KL-penalised token rewards, whitened
over the global batch; no critic, no group baseline.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/reinforce_pp.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/reinforce_pp.py:cpu   # CPU: the quickstart's model

REINFORCE++-baseline (the group-mean baseline variant for several samples per prompt) is
``--algorithm.adv-estimator reinforce_pp_baseline``. Whitening statistics are all-reduced over the DP ranks, so
advantages do not depend on how many ranks there are. GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k
--out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import (
    ActorConfig, AlgorithmConfig, Config, DataConfig, KLControlConfig, ModelConfig, OptimConfig, RolloutConfig,
    TrainerConfig, load_config_file,
)

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory

ALGORITHM = AlgorithmConfig(
    adv_estimator="reinforce_pp", gamma=1.0, use_kl_in_reward=True, kl_penalty="k2", kl_ctrl=KLControlConfig(kl_coef=0.001)
)

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10),
        mini_batch_size=128,
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        use_kl_loss=False,  # the KL lives in the reward
    ),
    rollout=RolloutConfig(n=4, temperature=1.0, max_response_length=1024, max_batch_size=512),
    data=DataConfig(
        train_files=["data/gsm8k/train.parquet"], val_files=["data/gsm8k/test.parquet"],
        train_batch_size=512, val_batch_size=1319, max_prompt_length=512,
    ),
    algorithm=ALGORITHM,
    trainer=TrainerConfig(total_steps=200, val_every=20, output_dir="outputs/reinforce_pp-gsm8k"),
)


def cpu() -> Config:
    """REINFORCE++ on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    cfg.actor.use_kl_loss = False
    cfg.algorithm = ALGORITHM
    cfg.trainer.output_dir = "outputs/reinforce_pp-cpu"
    return cfg
