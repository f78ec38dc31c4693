#!/usr/bin/env bash
# The vision quickstart, end to end on CPU:
#   1. build the tiny Qwen2.5-VL-style model (the quickstart's tokenizer plus the vision tokens, a two-block vision
#      tower, Qwen2-VL's image processor; random init)
#   2. write the shapes task (images drawn with PIL: the colour of the largest shape) in verl's multimodal schema
#   3. SFT warm start under torchrun (vision tower trained too)
#   4. GRPO under torchrun; metrics in outputs/vision-quickstart/metrics.jsonl, the samples (with their images'
#      thumbnails) in outputs/vision-quickstart/samples: python -m rlspmd.samples outputs/vision-quickstart
# NPROC=4 bash scripts/vision_quickstart.sh runs on 4 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
rm -rf outputs/vision-quickstart-sft outputs/vision-quickstart   # a fresh run each time (the trainer would resume)
python scripts/models/build_tiny.py --out models/tiny-vl --vision
python scripts/data/shapes.py --out-dir data/shapes --sft-other-style 0.7
torchrun --nproc-per-node "$NPROC" -m rlspmd.sft --config configs/sft_vision_quickstart.py
torchrun --nproc-per-node "$NPROC" -m rlspmd.train --config configs/vision_quickstart.py "$@"
echo "vision quickstart finished in $(( $(date +%s) - start )) s; metrics: outputs/vision-quickstart/metrics.jsonl"
