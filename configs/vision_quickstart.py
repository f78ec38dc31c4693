"""The vision quickstart: GRPO on the shapes task ("what colour is the largest shape?"), 2 CPU ranks.

    bash scripts/vision_quickstart.sh          # builds the model and data, runs the SFT warm start, then this

Starts from the SFT warm start (``configs/sft_vision_quickstart.py``), samples 8 answers per image, rewards the right
colour in the ``#### red`` style (``rlspmd.rewards.rules.shapes``), and validates greedily on the held-out images every
10 steps. Prompts are verl's multimodal rows (``<image>`` in the prompt, the PNG bytes in ``images``); the native
engine prefills with the vision tower's features and M-RoPE positions (docs/vision.md).
"""

from rlspmd.config import (
    ActorConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PPOClip,
    RolloutConfig,
    TrainerConfig,
)

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path="outputs/vision-quickstart-sft/hf"),
        optim=OptimConfig(lr=3e-5, warmup_steps=3),
        mini_batch_size=16,
        micro_batch_size=64,
        logprob_micro_batch_size=128,
        policy_loss=PPOClip(clip_ratio_high=0.28),
        kl_loss_coef=0.001,
    ),
    rollout=RolloutConfig(n=8, max_response_length=16, temperature=1.0),
    data=DataConfig(
        train_files=["data/shapes/train.parquet"],
        val_files=["data/shapes/test.parquet"],
        train_batch_size=32,
        val_batch_size=200,
        max_prompt_length=64,
    ),
    trainer=TrainerConfig(total_steps=20, val_every=10, output_dir="outputs/vision-quickstart"),
)
