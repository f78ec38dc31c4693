"""Warm start for the MoE quickstart: ``configs/sft_quickstart.py`` on the tiny Qwen3-MoE.

    python scripts/models/build_tiny.py --out models/tiny-moe --moe     # 8 experts of width 192, top-2, every layer
    torchrun --nproc-per-node 2 -m rlspmd.sft --config configs/sft_quickstart_moe.py

The same demonstrations, schedule and batch as the dense warm start; the loss adds the router's load-balancing loss
(the model's ``router_aux_loss_coef``, as transformers does when fine-tuning). SFT runs FSDP2 alone (no expert
parallel: the SFT entry point has no mesh section); the RL run shards the experts.
"""

from rlspmd.config import ModelConfig, OptimConfig, SFTConfig, SFTDataConfig

config = SFTConfig(
    model=ModelConfig(path="models/tiny-moe"),
    optim=OptimConfig(lr=2e-3, warmup_steps=50, schedule="cosine", min_lr_ratio=0.05),
    data=SFTDataConfig(train_files=["data/arithmetic/sft.parquet"], batch_size=64, max_length=128),
    micro_batch_size=64,
    total_steps=400,
    log_every=50,
    output_dir="outputs/quickstart-moe-sft",
)
