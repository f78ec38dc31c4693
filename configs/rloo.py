"""RLOO (Ahmadian et al. 2024, arXiv 2402.14740): REINFORCE with a leave-one-out baseline, no critic.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/rloo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/rloo.py:cpu   # CPU: the quickstart's tiny model

Each sample's baseline is the mean score of the other samples of its prompt. The KL to the reference is a
per-token penalty in the reward (as in the paper), so it enters the sequence reward the baseline is taken over.
GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import (
    ActorConfig, AlgorithmConfig, Config, DataConfig, KLControlConfig, ModelConfig, OptimConfig, RolloutConfig,
    TrainerConfig, load_config_file,
)

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory

ALGORITHM = AlgorithmConfig(adv_estimator="rloo", use_kl_in_reward=True, kl_penalty="k1", kl_ctrl=KLControlConfig(kl_coef=0.001))

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10),
        mini_batch_size=64,
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        use_kl_loss=False,
    ),
    rollout=RolloutConfig(n=8, temperature=1.0, max_response_length=1024, max_batch_size=512),
    data=DataConfig(
        train_files=["data/gsm8k/train.parquet"], val_files=["data/gsm8k/test.parquet"],
        train_batch_size=256, val_batch_size=1319, max_prompt_length=512,
    ),
    algorithm=ALGORITHM,
    trainer=TrainerConfig(total_steps=300, val_every=20, output_dir="outputs/rloo-gsm8k"),
)


def cpu() -> Config:
    """RLOO on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, arithmetic, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    cfg.actor.use_kl_loss = False
    cfg.algorithm = ALGORITHM
    cfg.trainer.output_dir = "outputs/rloo-cpu"
    return cfg
