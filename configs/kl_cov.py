"""KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped policy-gradient loss, plus a KL penalty on the tokens of
largest advantage-logprob covariance, so that entropy does not collapse.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/kl_cov.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/kl_cov.py:cpu   # CPU: the quickstart's tiny model

In each micro-batch the ``actor.kl_cov_ratio`` share of tokens with the largest covariance (A_t - mean A)(logp_t -
mean logp) get ``actor.kl_cov_coef * |logp - old_logp|`` added to their loss; no token is clipped. The paper's 7B
recipe: ratio 2e-3, coefficient 1 (32B: ratio 2e-4); token-level loss, no KL-to-reference term. Several
mini-batches per step make the penalty act (at the first one logp = old_logp). Clip-Cov is ``configs/clip_cov.py``.
GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import ActorConfig, AlgorithmConfig, Config, DataConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig, load_config_file

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory


def kl_cov_actor(actor: ActorConfig) -> ActorConfig:
    actor.policy_loss = "kl_cov"
    actor.kl_cov_ratio, actor.kl_cov_coef = 2e-3, 1.0
    actor.loss_agg_mode = "token-mean"
    actor.use_kl_loss = False
    return actor


config = Config(
    actor=kl_cov_actor(ActorConfig(
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
    trainer=TrainerConfig(total_steps=300, val_every=20, output_dir="outputs/kl-cov-gsm8k"),
)


def cpu() -> Config:
    """KL-Cov on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    kl_cov_actor(cfg.actor)
    cfg.actor.mini_batch_size = cfg.data.train_batch_size // 2  # two optimiser steps: the second is off-policy
    cfg.algorithm = AlgorithmConfig(adv_estimator="grpo")
    cfg.trainer.output_dir = "outputs/kl-cov-cpu"
    return cfg
