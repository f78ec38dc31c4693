"""Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO's clipped loss, plus the gradient of a few high-covariance
tokens removed, so that entropy does not collapse.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/clip_cov.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/clip_cov.py:cpu   # CPU: the quickstart's tiny model

Entropy falls when the policy raises tokens that are both likely and advantageous; the paper measures that with
the covariance (A_t - mean A)(logp_t - mean logp) and, in each micro-batch, draws ``actor.clip_cov_ratio`` of the
tokens whose covariance lies in (``actor.clip_cov_lb``, ``actor.clip_cov_ub``) and detaches them. The paper's
settings (and verl's defaults): ratio 2e-4, band (1, 5), token-level loss, no KL term. KL-Cov, the other
estimator of the paper, is ``configs/kl_cov.py``. GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir
data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import ActorConfig, AlgorithmConfig, Config, DataConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig, load_config_file

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory


def clip_cov_actor(actor: ActorConfig) -> ActorConfig:
    actor.policy_loss = "clip_cov"
    actor.clip_cov_ratio, actor.clip_cov_lb, actor.clip_cov_ub = 2e-4, 1.0, 5.0
    actor.clip_ratio_low, actor.clip_ratio_high = 0.2, 0.2
    actor.loss_agg_mode = "token-mean"
    actor.use_kl_loss = False
    return actor


config = Config(
    actor=clip_cov_actor(ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10),
        mini_batch_size=32,  # 8 optimiser steps per RL step
        micro_batch_size=16,
        logprob_micro_batch_size=32,
    )),
    rollout=RolloutConfig(n=8, temperature=1.0, max_response_length=1024, max_batch_size=512),
    data=DataConfig(
        train_files=["data/gsm8k/train.parquet"], val_files=["data/gsm8k/test.parquet"],
        train_batch_size=256, val_batch_size=1319, max_prompt_length=512,
    ),
    algorithm=AlgorithmConfig(adv_estimator="grpo"),
    trainer=TrainerConfig(total_steps=300, val_every=20, output_dir="outputs/clip-cov-gsm8k"),
)


def cpu() -> Config:
    """Clip-Cov on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    clip_cov_actor(cfg.actor)
    cfg.actor.clip_cov_ratio = 2e-3  # micro-batches of ~1-2k tokens: a few tokens each instead of the minimum one
    cfg.algorithm = AlgorithmConfig(adv_estimator="grpo")
    cfg.trainer.output_dir = "outputs/clip-cov-cpu"
    return cfg
