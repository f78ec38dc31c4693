"""GRPO with LoRA adapters (Hu et al. 2021, arXiv 2106.09685): only the adapters train, the reference is the base model.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/grpo_lora.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/grpo_lora.py:cpu   # CPU: the quickstart with LoRA

``configs/grpo.py`` with ``actor.lora``: the base weights stay frozen (sharded once, no gradients, no optimiser state),
the reference is the actor's engine with the adapters switched off (no second copy of the model), the rollout
generates with the adapters merged into the gathered weights, checkpoints hold the adapters and their optimiser
state, and ``scripts/export_hf.py`` writes a merged HF model plus the adapter in peft's format (``OUT/adapter``).
LoRA wants a learning rate about 10x a full fine-tune's. Needs ``pip install -e ".[lora]"`` (peft).
"""

from pathlib import Path

from rlspmd.config import LoraConfig, OptimConfig, load_config_file

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory

config = load_config_file(Path(__file__).with_name("grpo.py"))
config.actor.model.path = MODEL
config.actor.lora = LoraConfig(rank=32, alpha=64.0, target_modules=["all-linear"])
config.actor.optim = OptimConfig(lr=1e-5, warmup_steps=10)
config.trainer.output_dir = "outputs/grpo-lora-gsm8k"


def cpu():
    """The quickstart (``configs/quickstart.py``: the tiny model's SFT warm start, arithmetic, 2 CPU ranks)
    with LoRA."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.lora = LoraConfig(rank=8, alpha=16.0, target_modules=["all-linear"])
    cfg.actor.optim = OptimConfig(lr=1e-3, warmup_steps=5)
    cfg.trainer.output_dir = "outputs/grpo-lora-cpu"
    return cfg
