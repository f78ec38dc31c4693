"""DAPO (Yu et al. 2025, arXiv 2503.14476): clip-higher, dynamic sampling, token-level loss, overlong shaping.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/dapo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/dapo.py:cpu   # CPU: the quickstart's tiny model

The four pieces and their fields: clip-higher ``actor.policy_loss=PPOClip(clip_ratio_high=0.28)`` above its
``clip_ratio_low``; dynamic sampling ``algorithm.filter_groups`` (groups whose samples all score the same are dropped
and more prompts are generated, up to ``max_rounds`` rounds of ``gen_batch_size`` prompts, until
``data.train_batch_size`` groups carry signal); token-level aggregation ``actor.loss_agg_mode=token-mean``; soft
overlong punishment ``reward.overlong_buffer``. No KL term (the paper drops it). GSM8K: ``python scripts/data/gsm8k.py
--input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import (
    NativeConfig,
    GRPO,
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    FilterGroupsConfig,
    ModelConfig,
    OptimConfig,
    PPOClip,
    OverlongBufferConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    load_config_file,
)

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory


def dapo_algorithm(*, gen_batch_size: int | None, max_rounds: int) -> AlgorithmConfig:
    return AlgorithmConfig(
        adv_estimator=GRPO(),
        filter_groups=FilterGroupsConfig(
            enable=True, metric="task_score", max_rounds=max_rounds, gen_batch_size=gen_batch_size
        ),
    )


config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10, weight_decay=0.1),
        mini_batch_size=32,  # 4 optimiser steps per RL step
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        policy_loss=PPOClip(clip_ratio_low=0.2, clip_ratio_high=0.28),
        loss_agg_mode="token-mean",
        use_kl_loss=False,
    ),
    rollout=RolloutConfig(n=16, temperature=1.0, max_response_length=1024, engine=NativeConfig(max_batch_size=512)),
    data=DataConfig(
        train_files=["data/gsm8k/train.parquet"],
        val_files=["data/gsm8k/test.parquet"],
        train_batch_size=128,
        val_batch_size=1319,
        max_prompt_length=512,
    ),
    algorithm=dapo_algorithm(gen_batch_size=384, max_rounds=10),
    reward=RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=256, penalty_factor=1.0)),
    trainer=TrainerConfig(total_steps=300, val_every=20, output_dir="outputs/dapo-gsm8k"),
)


def cpu() -> Config:
    """DAPO on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, arithmetic, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    cfg.actor.policy_loss = PPOClip(clip_ratio_low=0.2, clip_ratio_high=0.28)
    cfg.actor.loss_agg_mode = "token-mean"
    cfg.actor.use_kl_loss = False
    cfg.algorithm = dapo_algorithm(gen_batch_size=None, max_rounds=3)
    cfg.reward = RewardConfig(overlong_buffer=OverlongBufferConfig(enable=True, len=8, penalty_factor=1.0))
    cfg.trainer.output_dir = "outputs/dapo-cpu"
    return cfg
