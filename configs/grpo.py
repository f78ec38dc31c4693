"""GRPO (Shao et al. 2024, arXiv 2402.03300): group-relative advantages, no critic, KL to the reference as a loss.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/grpo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/grpo.py:cpu   # CPU: the quickstart's tiny model

Variants are one override away: Dr.GRPO (arXiv 2503.20783) is ``--algorithm.adv-estimator.norm-adv-by-std False
--actor.loss-agg-mode seq-mean-token-sum-norm``; pass@k GRPO is ``algorithm.adv-estimator:grpo-passk``;
OPO is ``algorithm.adv-estimator:opo``; GPG is ``algorithm.adv-estimator:gpg actor.policy-loss:gpg``.
GSM8K comes from ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import (
    NativeConfig,
    GRPO,
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
    load_config_file,
)

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory (7B: see below)

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10),
        ppo_epochs=1,
        mini_batch_size=64,  # 4 optimiser steps per RL step
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        loss_agg_mode="seq-mean-token-mean",  # the paper's per-sequence mean
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
    algorithm=AlgorithmConfig(adv_estimator=GRPO()),
    trainer=TrainerConfig(total_steps=300, val_every=20, output_dir="outputs/grpo-gsm8k"),
)
# 7B on 8 x 80 GB: MODEL = Qwen2.5-7B-Instruct, actor.micro_batch_size=4, actor.logprob_micro_batch_size=8,
# actor.engine.cpu_offload=False; keep the rest.


def cpu() -> Config:
    """GRPO on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, arithmetic, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    cfg.algorithm = AlgorithmConfig(adv_estimator=GRPO())
    cfg.trainer.output_dir = "outputs/grpo-cpu"
    return cfg
