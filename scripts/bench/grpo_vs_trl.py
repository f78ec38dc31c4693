"""A GRPO step of rlspmd vs TRL's GRPOTrainer on the identical workload; prints both and the ratio as JSON.

    pip install trl==1.16.0
    python scripts/bench/grpo_vs_trl.py                       # grpo_tiny (hidden 256, 4 layers)
    python scripts/bench/grpo_vs_trl.py --which grpo_small    # hidden 512, 12 layers

Builds the workload (``grpo_workload.py``), then runs, one after the other in fresh processes,
``python -m rlspmd.train --config configs/bench/<which>.py`` and ``scripts/bench/trl_grpo.py`` on the same model and
prompts, and reads the JSON each prints as its last line. ``ratio`` = TRL sec/step over rlspmd sec/step (medians
over the steps after the first); > 1 means rlspmd is faster.
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
    models = build([a.which], data=ROOT / "data" / "bench" / "prompts.jsonl", num_prompts=256, prompt_tokens=27)
    ours = last_json(
        [
            sys.executable,
            "-m",
            "rlspmd.train",
            "--config",
            f"configs/bench/{a.which}.py",
            "--trainer.total-steps",
            str(a.steps),
        ]
    )["summary"]
    trl = last_json([sys.executable, "scripts/bench/trl_grpo.py", "--model", models[a.which], "--steps", str(a.steps)])
    emit(
        {
            "bench": "grpo_vs_trl",
            "workload": a.which,
            "rlspmd": {
                "sec_per_step": ours["sec_per_step"],
                "gen_tokens_per_sec": ours["gen_tokens_per_sec"],
                "stages_s": ours["mean_step_s"],
            },
            "trl": {"version": trl["trl"], "sec_per_step": trl["sec_per_step"], "step_s": trl["step_s"]},
            "ratio": trl["sec_per_step"] / ours["sec_per_step"],
            "target": 2.0,
        },
        a.out,
    )


if __name__ == "__main__":
    main()
