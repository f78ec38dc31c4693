"""Warm start for the vision quickstart: supervised fine-tuning of the tiny Qwen2.5-VL-style model on the shapes task.

    torchrun --nproc-per-node 2 -m rlspmd.sft --config configs/sft_vision_quickstart.py

The demonstrations (``scripts/data/shapes.py --sft-other-style 0.7``) name the colour of the largest shape in one of two
styles: ``#### red`` (what the task's reward accepts) or ``The answer is red.`` (not accepted). The warm start learns
to read the colours (its vision tower is trained too) and, decoding greedily, answers in the majority style: the
imperfection the GRPO run has to fix from reward alone.
"""

from rlspmd.config import ModelConfig, OptimConfig, SFTConfig, SFTDataConfig

config = SFTConfig(
    model=ModelConfig(path="models/tiny-vl"),
    optim=OptimConfig(lr=2e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.05),
    data=SFTDataConfig(train_files=["data/shapes/sft.parquet"], batch_size=64, max_length=96),
    micro_batch_size=64,
    total_steps=150,
    log_every=25,
    output_dir="outputs/vision-quickstart-sft",
)
