"""GPU benchmark workload ``q15``: ``grpo_q05``'s step on a 1.3 B model, for MFU at a larger size.

    python scripts/bench/grpo_workload.py --which grpo_q15
    python -m rlspmd.train --config configs/bench/grpo_q15.py

A random-init Qwen2 with Qwen2.5-1.5B's body and the bench vocabulary: hidden 1536, 28 layers, 12 heads / 2 KV heads,
intermediate 8960, vocab 8192, max positions 1024, tied embeddings (1.32 B parameters, fp32 master weights, bf16
compute). Same batch, prompts, lengths, micro-batches and loss as ``grpo_q05`` (estimated peak: ~27 GB of weights,
gradients, AdamW state and reference, plus ~23 GB of bf16 activations for a 32 x 283-token micro-batch; not yet
measured on a GPU).

``smoke``: a tiny stand-in (``models/bench-tiny``) for CPU smoke runs of the suite.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_q05 import workload  # noqa: E402

config = workload("models/bench-q15", "grpo_q15", steps=3)
smoke = workload(
    "models/bench-tiny",
    "grpo_q15_smoke",
    prompts=2,
    samples=2,
    new_tokens=8,
    micro=4,
    ref_micro=4,
    steps=1,
    data="data/bench/smoke_prompts.jsonl",
)
