"""Warm start for the agent quickstart: supervised fine-tuning of the tiny tool-calling model on arithmetic
conversations (``scripts/data/agent_arithmetic.py``).

    torchrun --nproc-per-node 2 -m rlspmd.sft --config configs/sft_agent_quickstart.py

30% of the demonstrations call the calculator and copy its result; 70% answer in their head. The operands have three
digits, more than the tiny model learns to add in a few hundred steps, so the warm start answers in its head under
greedy decoding and gets most sums wrong: the imperfection ``configs/agent_quickstart.py``'s GRPO run has to fix.
"""

from rlspmd.config import ModelConfig, OptimConfig, SFTConfig, SFTDataConfig

config = SFTConfig(
    model=ModelConfig(path="models/tiny-tools"),
    optim=OptimConfig(lr=2e-3, warmup_steps=50, schedule="cosine", min_lr_ratio=0.05),
    data=SFTDataConfig(
        train_files=["data/agent_arithmetic/sft.parquet"],
        messages_key="messages",
        tools=["calculator"],
        batch_size=64,
        max_length=192,
    ),
    micro_batch_size=64,
    total_steps=400,
    log_every=50,
    output_dir="outputs/agent-quickstart-sft",
)
