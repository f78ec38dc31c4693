"""GSPO (Zheng et al. 2025, arXiv 2507.18071): GRPO's advantages with a sequence-level importance ratio.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/gspo.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/gspo.py:cpu   # CPU: the quickstart's tiny model

The ratio is the geometric mean of the token ratios of a sequence and whole sequences are clipped, with the
paper's tiny clip range (3e-4 / 4e-4). Several mini-batches per step make the later ones off-policy, which is
where the sequence ratio matters. Other policy losses are one field away: ``actor.policy_loss`` in ppo_clip,
gspo, cispo, sapo (``actor.sapo_tau_pos`` / ``sapo_tau_neg``), gpg, gmpo. GSM8K: ``python scripts/data/gsm8k.py
--input ~/gsm8k --out-dir data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import ActorConfig, AlgorithmConfig, Config, DataConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig, load_config_file

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory


def gspo_actor(actor: ActorConfig) -> ActorConfig:
    actor.policy_loss = "gspo"
    actor.clip_ratio_low, actor.clip_ratio_high = 3e-4, 4e-4
    actor.loss_agg_mode = "seq-mean-token-mean"
    actor.use_kl_loss = False
    return actor


config = Config(
    actor=gspo_actor(ActorConfig(
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
    trainer=TrainerConfig(total_steps=300, val_every=20, output_dir="outputs/gspo-gsm8k"),
)


def cpu() -> Config:
    """GSPO on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    gspo_actor(cfg.actor)
    cfg.actor.mini_batch_size = cfg.data.train_batch_size // 2  # two optimiser steps: the second is off-policy
    cfg.algorithm = AlgorithmConfig(adv_estimator="grpo")
    cfg.trainer.output_dir = "outputs/gspo-cpu"
    return cfg
