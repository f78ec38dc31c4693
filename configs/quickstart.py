"""The quickstart: GRPO on the arithmetic task, 2 CPU ranks, a few minutes.

    bash scripts/quickstart.sh          # builds the model and data, runs the SFT warm start, then this

Starts from the SFT warm start (``configs/sft_quickstart.py``), samples 8 answers per prompt, rewards
exact answers in the ``#### N`` style, and validates greedily on the held-out split every 10 steps.
"""

from rlspmd.config import (
    ActorConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PPOClip,
    RefConfig,
    RolloutConfig,
    TrainerConfig,
)

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path="outputs/quickstart-sft/hf"),
        optim=OptimConfig(lr=3e-5, warmup_steps=5),
        mini_batch_size=16,
        micro_batch_size=64,
        logprob_micro_batch_size=128,
        policy_loss=PPOClip(clip_ratio_high=0.28),
        kl_loss_coef=0.001,
    ),
    ref=RefConfig(logprob_micro_batch_size=128),  # as the actor's log-prob pass: one forward per rank, not eight
    rollout=RolloutConfig(n=8, max_response_length=48, temperature=1.0),
    data=DataConfig(
        train_files=["data/arithmetic/train.parquet"],
        val_files=["data/arithmetic/test.parquet"],
        train_batch_size=32,
        val_batch_size=500,
        max_prompt_length=64,
    ),
    trainer=TrainerConfig(total_steps=40, val_every=10, output_dir="outputs/quickstart"),
)
