"""Warm start for the quickstart: supervised fine-tuning of the tiny model on the arithmetic demonstrations.

    torchrun --nproc-per-node 2 -m rlspmd.sft --config configs/sft_quickstart.py

The demonstrations (``scripts/data/arithmetic.py --sft-other-style 0.7``) end in one of two answer styles:
``#### 70`` (what the task's checker accepts, as GSM8K's does) or ``The answer is 70.`` (not accepted).
The resulting model does the arithmetic but, decoding greedily, answers in the majority (unaccepted) style: the
imperfection the quickstart's GRPO run has to fix from reward alone.
"""

from rlspmd.config import ModelConfig, OptimConfig, SFTConfig, SFTDataConfig

config = SFTConfig(
    model=ModelConfig(path="models/tiny"),
    optim=OptimConfig(lr=2e-3, warmup_steps=50, schedule="cosine", min_lr_ratio=0.05),
    data=SFTDataConfig(train_files=["data/arithmetic/sft.parquet"], batch_size=64, max_length=128),
    micro_batch_size=64,
    total_steps=600,  # 400 left the arithmetic, GRPO's ceiling, seed-dependent: 0.61-0.69 after 40 steps, 0.83-0.88 now
    log_every=50,
    output_dir="outputs/quickstart-sft",
)
