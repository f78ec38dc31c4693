"""Step throughput of the GRPO benchmark workload on 1 rank vs 2 ranks (same global batch), as JSON.

    python scripts/bench/scaling.py                        # grpo_tiny; torchrun --nproc-per-node 1, then 2

Each run is ``torchrun --nproc-per-node N -m rlspmd.train --config configs/bench/<which>.py``; 2 ranks split the 16
sequences of a step 8 + 8 (FSDP2 over Gloo on CPU). torchrun gives each of N > 1 ranks one thread
(``OMP_NUM_THREADS=1``) while 1 rank keeps torch's default, so on a 2-core machine both layouts use both cores.
``speedup`` = sec/step on 1 rank over sec/step on 2 ranks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, emit, last_json  # noqa: E402
from grpo_workload import PRESETS, build  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=sorted(PRESETS), default="grpo_tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    build([a.which], data=ROOT / "data" / "bench" / "prompts.jsonl", num_prompts=256, prompt_tokens=27)
    runs = {}
    for n in (1, 2):
        runs[n] = last_json(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                "-m",
                "rlspmd.train",
                "--config",
                f"configs/bench/{a.which}.py",
                "--trainer.total-steps",
                str(a.steps),
                "--trainer.output-dir",
                f"outputs/bench/scaling_{n}",
            ]
        )["summary"]
    emit(
        {
            "bench": "scaling",
            "workload": a.which,
            "ranks": {
                str(n): {
                    "sec_per_step": r["sec_per_step"],
                    "tokens_per_sec": r["tokens_per_sec"],
                    "gen_tokens_per_sec": r["gen_tokens_per_sec"],
                    "stages_s": r["mean_step_s"],
                }
                for n, r in runs.items()
            },
            "speedup": runs[1]["sec_per_step"] / runs[2]["sec_per_step"],
        },
        a.out,
    )


if __name__ == "__main__":
    main()
