"""PPO with a critic (Schulman et al. 2017, arXiv 1707.06347; InstructGPT-style KL penalty in the reward).

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/ppo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/ppo.py:cpu   # CPU: the quickstart's tiny model

Advantages are GAE over per-token rewards (the score on the last token minus ``kl_coef * KL(pi || pi_ref)`` on
every token), whitened over the global batch. The critic is a value model initialised from the actor's weights
with a fresh scalar head (``critic.model_path`` to start from elsewhere, e.g. a reward model); it trains alone
for ``critic.warmup_steps`` before the actor starts. GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k
--out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import (
    NativeConfig,
    GAE,
    ActorConfig,
    AdaptiveKL,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    FixedKL,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
    load_config_file,
)

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10),
        ppo_epochs=1,
        mini_batch_size=128,  # 4 optimiser steps per RL step
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        use_kl_loss=False,  # the KL lives in the reward instead
    ),
    critic=CriticConfig(
        gradient_checkpointing=True,
        optim=OptimConfig(lr=1e-5, warmup_steps=10),
        mini_batch_size=128,
        micro_batch_size=16,
        values_micro_batch_size=32,
        cliprange_value=0.5,
        warmup_steps=5,
    ),
    rollout=RolloutConfig(n=1, temperature=1.0, max_response_length=1024, engine=NativeConfig(max_batch_size=512)),
    data=DataConfig(
        train_files=["data/gsm8k/train.parquet"],
        val_files=["data/gsm8k/test.parquet"],
        train_batch_size=512,
        val_batch_size=1319,
        max_prompt_length=512,
    ),
    algorithm=AlgorithmConfig(
        adv_estimator=GAE(gamma=1.0, lam=1.0),
        use_kl_in_reward=True,
        kl_penalty="k1",
        kl_ctrl=FixedKL(kl_coef=0.001),
    ),
    trainer=TrainerConfig(total_steps=200, val_every=20, output_dir="outputs/ppo-gsm8k"),
)


def cpu() -> Config:
    """PPO on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, arithmetic, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    cfg.actor.use_kl_loss = False
    cfg.critic = CriticConfig(
        optim=OptimConfig(lr=1e-3),
        mini_batch_size=cfg.actor.mini_batch_size,
        micro_batch_size=64,
        values_micro_batch_size=128,
        warmup_steps=2,
    )
    cfg.algorithm = AlgorithmConfig(
        adv_estimator=GAE(lam=0.95),
        use_kl_in_reward=True,
        kl_ctrl=AdaptiveKL(kl_coef=0.001, target_kl=0.02, horizon=1000),
    )
    cfg.trainer.output_dir = "outputs/ppo-cpu"
    return cfg
