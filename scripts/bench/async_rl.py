"""Asynchronous RL benchmark: seconds per step and accuracy rise, synchronous split loop vs ``trainer.max_staleness``.
Prints JSON.

    bash scripts/quickstart.sh                         # once: the tiny model, the data, the SFT warm start
    python scripts/bench/async_rl.py --steps 10        # 2 CPU ranks: actor on rank 0, rollout on rank 1

Each run is the quickstart (``configs/quickstart.py``) under its own ``torchrun``, in split placement (1 actor rank,
1 rollout rank, ``OMP_NUM_THREADS=1``: one thread each), with the workload brought as close to equal stage times as
the quickstart goes: one optimiser update per step (``actor.mini_batch_size = data.train_batch_size``, so the
update's own forward gives the old log-probs) and no reference model (no KL loss). Training a token still costs
about twice generating it here (forward + backward against one cached forward), so the update takes ~2x the
generation and perfect overlap would give ~1.45x (``overlap_ceiling``); top-k / top-p sampling (``-- --rollout.top-k
50 --rollout.top-p 0.95``) brings generation to half the update (ceiling ~1.5x). Then:

* ``sync``: ``trainer.max_staleness=0``, the synchronous loop: the actor rank waits while the rollout rank generates,
  and the other way round.
* ``async``: ``trainer.max_staleness=--staleness``: the rollout rank generates step t+k's batch while the actor
  trains on step t (``algorithm.rollout_correction.mode=auto`` resolves to ``tis``).

Per run: ``sec_per_step`` (the trainer's median step time after the first step), ``gen_s`` (the rollout rank's
generation, engine time) and ``train_s`` (the actor rank's old-log-prob pass and update), all stage times, validation
accuracy before training and after ``--steps`` steps (greedy, ``--val-samples`` held-out prompts) and its rise.
Summary: ``speedup`` = sync / async seconds per step (with ``--repeats`` N, N pairs run alternately, so that a
pair sees one machine load, and the median of their ratios; ``speedups`` lists them), ``overlap_ceiling`` =
(gen + train) / max(gen, train) of the sync run (the speedup of a perfect overlap), ``acc_rise_gap`` = sync rise -
async rise (points). Trainer overrides for both runs go after ``--``
(``python scripts/bench/async_rl.py --steps 10 -- --rollout.n 4``).
The machine is described in ``machine`` (load average before and after): on a shared machine re-run for final
figures and compare only ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, run_quickstart  # noqa: E402


def run(args, staleness: int, out: Path) -> dict:
    _, rows, summary = run_quickstart(
        args,
        out,
        [
            "--mesh.actor-ranks",
            "0",
            "--mesh.rollout-ranks",
            "1",
            "--actor.mini-batch-size",
            "32",
            "--actor.no-use-kl-loss",
            "--trainer.total-steps",
            str(args.steps),
            "--trainer.val-every",
            str(args.steps),
            "--trainer.max-staleness",
            str(staleness),
            *args.override,
        ],
        what=f"with max_staleness={staleness}",
    )
    val = {r["step"]: r["val/acc"] for r in rows if "val/acc" in r}
    train = [r for r in rows if r["step"] > 0]
    mean = summary["mean_step_s"]
    return {
        "max_staleness": staleness,
        "sec_per_step": summary["sec_per_step"],
        "wall_s": summary["wall_s"],
        # the two stages the pipeline overlaps, each on its own rank: the rollout rank's generation (engine time) and
        # the actor rank's training (old log-probs, when computed, and the update)
        "gen_s": round(mean.get("rollout/gen", 0.0), 4),
        "train_s": round(mean.get("old_log_prob", 0.0) + mean.get("update_actor", 0.0), 4),
        "mean_step_s": {k: round(v, 4) for k, v in mean.items() if v > 1e-3},
        "val_acc_before": val[0],
        "val_acc_after": val[args.steps],
        "acc_rise": val[args.steps] - val[0],
        "train_acc": [round(r["acc/mean"], 4) for r in train],
        "staleness_mean": [r.get("rollout/staleness/mean") for r in train],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="outputs/quickstart-sft/hf", help="the quickstart's SFT warm start")
    ap.add_argument("--data", default="data/arithmetic", help="the quickstart's data directory")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--val-samples", type=int, default=200)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="sync/async pairs, run alternately; speedup is the median of the pairs' ratios",
    )
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("override", nargs="*", help="more trainer overrides for both runs, after --, e.g. -- --rollout.n 4")
    args = ap.parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # sync then async, back to back: a pair sees the same machine load
            pairs.append((run(args, 0, Path(tmp) / f"sync{i}"), run(args, args.staleness, Path(tmp) / f"async{i}")))
    speedups = [s["sec_per_step"] / a["sec_per_step"] for s, a in pairs]
    sync, asyn = pairs[0]
    result = {
        "bench": "async_rl",
        "steps": args.steps,
        "placement": "split: actor rank 0, rollout rank 1, 1 thread each",
        "sync": sync,
        "async": asyn,
        "speedup": statistics.median(speedups),
        "speedups": speedups,
        # what perfect overlap would give: the synchronous step's two stages, run side by side
        "overlap_ceiling": (sync["gen_s"] + sync["train_s"]) / max(sync["gen_s"], sync["train_s"], 1e-9),
        "acc_rise_gap_points": 100 * (sync["acc_rise"] - asyn["acc_rise"]),
        "load_avg_start": load_start,
    }
    if args.repeats > 1:
        result["repeats"] = [{"sync": s, "async": a} for s, a in pairs[1:]]
    emit(result, args.out)


if __name__ == "__main__":
    main()
