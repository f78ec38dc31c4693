#!/usr/bin/env bash
# On-policy distillation, end to end on CPU (2 ranks):
#   1. the GRPO quickstart (scripts/quickstart.sh: tiny model, data, SFT warm start, 40 GRPO steps), unless its last
#      policy is already there: saved as a Hugging Face directory, it is the teacher
#   2. distillation: a fresh student from the same SFT warm start learns from the teacher alone (configs/distill_quickstart.py)
#   3. GRPO from the same warm start with the student's steps, samples per step and learning rate (the comparison)
#   4. the validation curves side by side, and the step where each first reaches 90% of the teacher's accuracy
# NPROC=4 runs on 4 ranks; arguments go to the distillation run (e.g. teacher.signal:reverse-kl).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
TEACHER=outputs/quickstart/checkpoints/step_00000040/hf
if [ ! -f "$TEACHER/model.safetensors" ]; then
  bash scripts/quickstart.sh --checkpoint.save-hf --trainer.val-every 5
fi
rm -rf outputs/distill_quickstart outputs/distill_quickstart_grpo   # fresh runs (the trainer would otherwise resume)
torchrun --nproc-per-node "$NPROC" -m rlspmd.train --config configs/distill_quickstart.py "$@"
torchrun --nproc-per-node "$NPROC" -m rlspmd.train --config configs/quickstart.py --actor.optim.lr 1e-4 \
  --trainer.total-steps 20 --trainer.val-every 2 --trainer.output-dir outputs/distill_quickstart_grpo
python - <<'PY'
import json

def val(run):
    rows = (json.loads(line) for line in open(f"outputs/{run}/metrics.jsonl"))
    return {r["step"]: r["val/acc"] for r in rows if "val/acc" in r}

teacher = val("quickstart")[40]  # the teacher is the GRPO quickstart's step-40 policy
target = 0.9 * teacher
runs = {
    "distillation (GKD, lr 1e-4)": val("distill_quickstart"),
    "GRPO (lr 1e-4)": val("distill_quickstart_grpo"),
    "GRPO quickstart (lr 3e-5)": val("quickstart"),
}
print(f"teacher val/acc {teacher:.3f}; 90% of it: {target:.3f}")
for name, curve in runs.items():
    first = next((s for s, a in sorted(curve.items()) if a >= target), None)
    points = ", ".join(f"{s}: {a:.3f}" for s, a in sorted(curve.items()) if s <= 20)
    print(f"{name:30s} first step >= 90% of the teacher: {first}   val/acc by step: {points}")
PY
echo "distillation quickstart finished in $(( $(date +%s) - start )) s"
