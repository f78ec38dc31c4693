"""A GRPO step of rlspmd vs TRL's GRPOTrainer on the identical workload, stage by stage, against the machine's floor;
prints one JSON line.

    pip install -e ".[bench]"                                  # trl==1.16.0
    python scripts/bench/grpo_vs_trl.py --which grpo_smollm2   # SmolLM2-135M-Instruct (the real model)
    python scripts/bench/grpo_vs_trl.py                        # grpo_tiny (hidden 256, 4 layers)
    python scripts/bench/grpo_vs_trl.py --which grpo_small     # hidden 512, 12 layers

Builds the workload (``grpo_workload.py``), measures the floor (``grpo_floor.py``: the step's matmuls and its
optimiser and cast traffic in float32 and, where the CPU multiplies bfloat16 natively, bfloat16, with the machine's
peaks), then runs ``--rounds`` rounds, each a fresh process of every contender in turn, so a load change on a shared
machine hits all of them alike:

- rlspmd: ``scripts/bench/grpo_stages.py --config configs/bench/<which>.py --split-update``, the trainer in its
  defaults for the machine (the compute dtype ``actor.engine.param_dtype=auto`` picks is reported);
- TRL, at each of ``--trl-settings`` (``fp32``; ``bf16``: TRL's ``bf16=True``), gradient checkpointing off, the
  same model and prompts (``trl_grpo.py``).

Stages (medians over every round's steps after the first): ``gen``, ``ref``, ``update_fwd``, ``update_bwd``
(backward, loss, clipping), ``optim``, ``other`` (rewards, advantages, bookkeeping); ``update`` is the sum of the
update's three. ``ratio`` = TRL's fastest setting's sec/step over rlspmd's; > 1 means rlspmd is faster.
``floor_share`` is, per stage, the floor's seconds over the measured ones (1.0: at the floor), for rlspmd against the
floor of its own compute dtype and for TRL against its setting's; ``rlspmd_over_floor`` the step over its floor.
rlspmd packs each group's prompt once (``model.share_prompts``), so its step is also given over the floor of that
smaller workload (``shared_prefix``, each prompt's tokens once in the reference and the update):
``rlspmd_over_shared_prefix_floor``, the stricter figure, and ``floor_share.rlspmd_shared_prefix``.
The machine's load average is recorded before and after every run: compare figures from a quiet machine only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, emit, last_json  # noqa: E402
from grpo_workload import PRESETS, build, prompts_file  # noqa: E402

TARGETS = {"grpo_smollm2": {"ratio": 3.0, "over_floor": 1.5}}
DEFAULT_TARGET = {"ratio": 2.0, "over_floor": None}
FLOOR_STAGES = ("gen", "ref", "update")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def stage_medians(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Per-stage medians over the given steps' stage seconds, ``update`` the sum of its parts and ``other`` the step's
    remainder, each step's own."""
    rows = []
    for s in per_step:
        s = dict(s)
        if "update_fwd" in s:
            s["update"] = s["update_fwd"] + s.get("update_bwd", 0.0) + s.get("optim", 0.0)
        if "step" in s:
            s["other"] = s["step"] - sum(s.get(k, 0.0) for k in FLOOR_STAGES)
        rows.append(s)
    names = sorted({k for s in rows for k in s})
    return {k: round(statistics.median(s.get(k, 0.0) for s in rows), 4) for k in names}


def run_rlspmd(which: str, steps: int) -> dict:
    cmd = [sys.executable, "scripts/bench/grpo_stages.py", "--config", f"configs/bench/{which}.py", "--split-update"]
    cmd += ["--steps", str(steps), "--profile-step", "0", "--output-dir", f"outputs/bench/{which}_vs_trl"]
    before = load()
    r = last_json(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)})
    steps_ = r["stages_s_all"][1:] or r["stages_s_all"]
    return {"steps": steps_, "compute_dtype": r["compute_dtype"], "load_before": before, "load_after": load()}


def run_trl(model: str, data: Path, setting: str, steps: int) -> dict:
    cmd = [sys.executable, "scripts/bench/trl_grpo.py", "--model", model, "--data", str(data), "--steps", str(steps)]
    before = load()
    r = last_json(cmd + (["--bf16"] if setting == "bf16" else []))
    if "skipped" in r:
        return {"skipped": r["skipped"]}
    steps_ = [{**s, "step": t} for s, t in zip(r["stages_s_all"], r["step_s"])]
    steps_ = steps_[1:] or steps_
    return {"steps": steps_, "version": r["trl"], "load_before": before, "load_after": load()}


def shares(floor: dict[str, float], stages: dict[str, float]) -> dict[str, float]:
    out = {k: round(floor[k] / stages[k], 3) for k in FLOOR_STAGES if stages.get(k)}
    out["step"] = round(floor["total"] / stages["step"], 3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=sorted(PRESETS), default="grpo_tiny")
    p.add_argument("--steps", type=int, default=4, help="steps per rlspmd run (the first is not counted)")
    p.add_argument("--trl-steps", type=int, default=4, help="steps per TRL run (the first is not counted)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of every contender")
    p.add_argument(
        "--trl-settings",
        nargs="+",
        choices=["fp32", "bf16"],
        default=None,
        help="default: fp32, and bf16 where the CPU multiplies bfloat16 natively",
    )
    p.add_argument("--no-floor", action="store_true", help="skip grpo_floor.py")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    from rlspmd.engines.base import native_bf16

    models = build([a.which], num_prompts=256, prompt_tokens=27)
    data = prompts_file(a.which)
    bf16 = native_bf16()
    settings = a.trl_settings or (["fp32", "bf16"] if bf16 else ["fp32"])
    floor = None
    if not a.no_floor:
        dtypes = ["float32", "bfloat16"] if bf16 else ["float32"]
        floor = last_json([sys.executable, "scripts/bench/grpo_floor.py", "--which", a.which, "--dtypes", *dtypes])
    ours: list[dict] = []
    theirs: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in range(a.rounds):
        ours.append(run_rlspmd(a.which, a.steps))
        for s in settings:
            theirs[s].append(run_trl(models[a.which], data, s, a.trl_steps))

    rl = {
        "compute_dtype": ours[0]["compute_dtype"],
        "stages_s": stage_medians([s for r in ours for s in r["steps"]]),
        "sec_per_step_by_round": [statistics.median(s["step"] for s in r["steps"]) for r in ours],
        "load": [(r["load_before"], r["load_after"]) for r in ours],
    }
    rl["sec_per_step"] = rl["stages_s"]["step"]
    trl: dict = {"settings": {}}
    for s, runs in theirs.items():
        if any("skipped" in r for r in runs):
            trl["skipped"] = runs[0]["skipped"]
            break
        st = stage_medians([x for r in runs for x in r["steps"]])
        trl["version"] = runs[0]["version"]
        trl["settings"][s] = {
            "sec_per_step": st["step"],
            "stages_s": st,
            "sec_per_step_by_round": [statistics.median(x["step"] for x in r["steps"]) for r in runs],
            "load": [(r["load_before"], r["load_after"]) for r in runs],
        }
    result = {"bench": "grpo_vs_trl", "workload": a.which, "rounds": a.rounds, "rlspmd": rl, "trl": trl}
    if trl["settings"]:
        best = min(trl["settings"], key=lambda s: trl["settings"][s]["sec_per_step"])
        trl["fastest"] = best
        trl["sec_per_step"] = trl["settings"][best]["sec_per_step"]
        result["ratio"] = round(trl["sec_per_step"] / rl["sec_per_step"], 3)
    else:
        result["ratio"] = None
    if floor is not None:
        by = floor["by_dtype"]
        result["floor"] = {
            "peaks": floor["peaks"],
            "floor_s": {d: f["full"]["floor_s"] for d, f in by.items()},
            "shared_prefix_floor_s": {d: f["shared_prefix"]["floor_s"] for d, f in by.items()},
            "gflop": by[next(iter(by))]["full"]["gflop"],
        }
        own = by.get(rl["compute_dtype"])
        share = {}
        if own is not None:
            share["rlspmd"] = shares(own["full"]["floor_s"], rl["stages_s"])
            result["rlspmd_over_floor"] = round(rl["sec_per_step"] / own["full"]["floor_s"]["total"], 3)
            # rlspmd packs each group's prompt once (model.share_prompts): the floor of that work is the stricter one
            share["rlspmd_shared_prefix"] = shares(own["shared_prefix"]["floor_s"], rl["stages_s"])
            result["rlspmd_over_shared_prefix_floor"] = round(
                rl["sec_per_step"] / own["shared_prefix"]["floor_s"]["total"], 3
            )
        for s, v in trl["settings"].items():
            d = by.get("bfloat16" if s == "bf16" else "float32")
            if d is not None:
                share[f"trl_{s}"] = shares(d["full"]["floor_s"], v["stages_s"])
        result["floor_share"] = share
    result["target"] = TARGETS.get(a.which, DEFAULT_TARGET)
    emit(result, a.out)


if __name__ == "__main__":
    main()
