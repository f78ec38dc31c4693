"""The GRPO benchmark workload of ``configs/bench/grpo_tiny.py`` on the larger model (hidden 512, 12 layers,
8 heads / 4 KV heads, intermediate 1376, vocab 8192).

    python scripts/bench/grpo_workload.py --which grpo_small
    python -m rlspmd.train --config configs/bench/grpo_small.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_tiny import workload  # noqa: E402

config = workload("models/bench-512", "grpo_small", steps=4)
