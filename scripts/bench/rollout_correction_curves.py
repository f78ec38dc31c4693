"""Rollout correction with a bf16 rollout: learning curves of the quickstart with the correction off, token-level
TIS and sequence-level MIS. Prints JSON.

    bash scripts/quickstart.sh                                  # once: the tiny model, the data, the SFT warm start
    python scripts/bench/rollout_correction_curves.py --steps 30 # 3 runs on 2 CPU ranks, ~10 min on 2 cores

Each run is the quickstart (``configs/quickstart.py``, colocated on 2 ranks, one thread each) with the rollout
engine's weights in bfloat16 (``rollout.dtype``) while the actor trains in float32, so pi_rollout != pi_train: the
rollout samples from bf16-rounded weights with bf16 matmuls, and the trainer's log-probs of those samples differ. The
quickstart makes two optimiser updates per step, so the old log-probs are recomputed and the correction is applied by
the step's stage (decoupled mode). Runs, all from the same seed:

* ``off``: ``algorithm.rollout_correction.mode=off`` (the mismatch is logged, nothing corrects it);
* ``tis_token``: truncated importance weights min(rho_t, 2) per token;
* ``mis_sequence``: sequences whose geometric-mean ratio leaves [0.999, 1.001] are dropped from the loss (what
  ``mode=auto`` resolves to for this setting).

Per run: greedy validation accuracy every ``--val-every`` steps on ``--val-samples`` held-out prompts (``val_acc``:
[step, acc] pairs), the training accuracy per step, and per step the mismatch (``kl_k3``: KL(rollout || train) per
token, k3 estimator; ``logprob_gap``; ``ratio_out_frac``: share of tokens whose ratio leaves [1/2, 2]) and what the
correction did (``is_weight_mean``, ``truncated_frac``, ``masked_frac``: the share of units outside the band, also
recorded when the mode does not reject). Summary: each run's validation rise and its gap to ``off``.
Absolute times depend on the machine's load (``load_avg``); the curves do not.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, run_quickstart  # noqa: E402

RC = "--algorithm.rollout-correction."
RUNS = {
    "off": [f"{RC}mode", "off"],
    "tis_token": [f"{RC}mode", "tis", f"{RC}level", "token"],
    "mis_sequence": [f"{RC}mode", "mis", f"{RC}level", "sequence"],
}
PER_STEP = {
    "train_acc": "acc/mean",
    "reward": "reward/mean",
    "response_length": "response_length/mean",
    "kl_k3": "rollout_corr/mismatch/kl_k3",
    "logprob_gap": "rollout/logprob_gap",
    "ratio_out_frac": "rollout_corr/mismatch/ratio_out_of_bound_frac",
    "is_weight_mean": "rollout_corr/is_weight_mean",
    "truncated_frac": "rollout_corr/truncated_frac",
    "masked_frac": "rollout_corr/masked_frac",
}


def run(args, name: str, out: Path) -> dict:
    stdout, rows, summary = run_quickstart(
        args,
        out,
        [
            "--rollout.dtype",
            "bfloat16",
            *RUNS[name],
            "--trainer.total-steps",
            str(args.steps),
            "--trainer.val-every",
            str(args.val_every),
        ],
        what=name,
    )
    resolved = next((line for line in stdout.splitlines() if "rollout correction:" in line), "")
    train = [r for r in rows if r["step"] > 0]
    val = [[r["step"], r["val/acc"]] for r in rows if "val/acc" in r]
    return {
        "resolved": resolved.split("rollout correction:", 1)[-1].strip(),
        "val_acc": val,
        "val_rise": val[-1][1] - val[0][1],
        **{k: [round(r.get(key, float("nan")), 5) for r in train] for k, key in PER_STEP.items()},
        "sec_per_step": summary.get("sec_per_step"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="outputs/quickstart-sft/hf", help="the quickstart's SFT warm start")
    ap.add_argument("--data", default="data/arithmetic", help="the quickstart's data directory")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--val-samples", type=int, default=200)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(args, name, Path(tmp) / name) for name in args.runs}
    result = {
        "bench": "rollout_correction_curves",
        "steps": args.steps,
        "rollout_dtype": "bfloat16",
        "actor_dtype": "float32",
        "val_samples": args.val_samples,
        "runs": runs,
        "val_rise": {k: r["val_rise"] for k, r in runs.items()},
        "mean_kl_k3": {k: sum(r["kl_k3"]) / len(r["kl_k3"]) for k, r in runs.items()},
        "load_avg_start": load_start,
    }
    if "off" in runs:
        result["val_rise_minus_off_points"] = {
            k: 100 * (r["val_rise"] - runs["off"]["val_rise"]) for k, r in runs.items()
        }
    emit(result, args.out)


if __name__ == "__main__":
    main()
