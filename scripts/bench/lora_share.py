"""What LoRA trains: trainable parameters and AdamW state as a share of full fine-tuning. Prints JSON.

    python scripts/bench/lora_share.py                         # q05's shape (Qwen2.5-0.5B's body, vocab 8192), r=32
    python scripts/bench/lora_share.py --rank 8 --hidden 128 --layers 4 --heads 4 --kv-heads 2 --intermediate 352 \\
        --vocab 1024

The model is built on the meta device (no memory, no files) and gets the adapters ``actor.lora`` would inject
(``rlspmd/models/lora.py: apply_lora``, peft). AdamW keeps two float32 moments per trainable parameter, so the optimiser
share equals the trainable share; gradients are held for the trainable parameters only, too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlspmd.config import LoraConfig  # noqa: E402
from rlspmd.models.lora import apply_lora  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64.0)
    p.add_argument("--targets", nargs="+", default=["all-linear"])
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=8192)
    a = p.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        intermediate_size=a.intermediate,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoraConfig(rank=a.rank, alpha=a.alpha, target_modules=a.targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        json.dumps(
            {
                "bench": "lora_share",
                "rank": a.rank,
                "targets": a.targets,
                "base_params": total,
                "adapter_params": trainable,
                "trainable_share": trainable / total,
                "adamw_state_bytes_full": 8 * total,
                "adamw_state_bytes_lora": 8 * trainable,
                "optimizer_memory_share": trainable / total,
            }
        )
    )


if __name__ == "__main__":
    main()
