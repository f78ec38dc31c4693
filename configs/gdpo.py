"""GDPO (Liu et al. 2026, arXiv 2601.05242): several rewards, each normalised within its group, then weighted,
summed and whitened over the batch.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/gdpo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/gdpo.py:cpu   # CPU: the quickstart's tiny model

GRPO on a summed reward gives, say, (correct, well formatted) in one group and (wrong, well formatted) in another
the same advantage whenever the sums' group statistics match; GDPO normalises each reward in its group first, so
the combinations stay apart, and whitens the weighted sum so its scale does not grow with the number of rewards.
The reward role puts the components in the batch field ``reward_components_BK`` (one column per reward: the task's
rule score, then each function of ``reward.components``) and the advantage stage weighs them with
``GDPO.reward_weights`` (``--algorithm.adv-estimator.reward-weights``); here two rewards, answer correctness (the task's
rule score) and format (the response ends in a ``#### <number>`` line, ``rlspmd.rewards.rules:answer_format``), weighted
1 and 0.5. Each is logged: ``reward/task_score``, ``reward/component/answer_format``.
GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import (
    NativeConfig,
    GDPO,
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    load_config_file,
)

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory


COMPONENTS = ["rlspmd.rewards.rules:answer_format"]
"""Rewards besides the task's rule score: columns 2.. of ``reward_components_BK``."""


def gdpo_algorithm() -> AlgorithmConfig:
    return AlgorithmConfig(adv_estimator=GDPO(reward_weights=[1.0, 0.5]))  # correctness, format


config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10),
        mini_batch_size=64,  # 4 optimiser steps per RL step
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        loss_agg_mode="token-mean",
        use_kl_loss=True,
        kl_loss_type="k3",
        kl_loss_coef=0.001,
    ),
    rollout=RolloutConfig(n=8, temperature=1.0, max_response_length=1024, engine=NativeConfig(max_batch_size=512)),
    data=DataConfig(
        train_files=["data/gsm8k/train.parquet"],
        val_files=["data/gsm8k/test.parquet"],
        train_batch_size=256,
        val_batch_size=1319,
        max_prompt_length=512,
    ),
    algorithm=gdpo_algorithm(),
    reward=RewardConfig(components=list(COMPONENTS)),
    trainer=TrainerConfig(total_steps=300, val_every=20, output_dir="outputs/gdpo-gsm8k"),
)


def cpu() -> Config:
    """GDPO on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, 2 CPU ranks. Its warm
    start answers in the wrong style 70% of the time, so the format reward carries signal of its own."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    cfg.algorithm = gdpo_algorithm()
    cfg.reward.components = list(COMPONENTS)
    cfg.trainer.output_dir = "outputs/gdpo-cpu"
    return cfg
