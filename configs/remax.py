"""ReMax (Li et al. 2023, arXiv 2310.10505): REINFORCE with the score of the greedy response as the baseline.

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/remax.py       # GPU: MODEL below on GSM8K
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/remax.py:cpu   # CPU: the quickstart's tiny model

Every prompt gets one extra greedy generation, scored like the samples, in the rollout stage; the advantage of a
sample is its score minus that baseline. No critic, no group needed (one sample per prompt). KL to the
reference as a per-token penalty in the reward. GSM8K: ``python scripts/data/gsm8k.py --input ~/gsm8k --out-dir
data/gsm8k``.
"""

from pathlib import Path

from rlspmd.config import (
    ActorConfig, AlgorithmConfig, Config, DataConfig, KLControlConfig, ModelConfig, OptimConfig, RolloutConfig,
    TrainerConfig, load_config_file,
)

MODEL = "models/Qwen2.5-0.5B-Instruct"  # the one line to edit: a local Hugging Face model directory

ALGORITHM = AlgorithmConfig(adv_estimator="remax", use_kl_in_reward=True, kl_penalty="k1", kl_ctrl=KLControlConfig(kl_coef=0.001))

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path=MODEL, gradient_checkpointing=True),
        optim=OptimConfig(lr=1e-6, warmup_steps=10),
        mini_batch_size=128,
        micro_batch_size=16,
        logprob_micro_batch_size=32,
        use_kl_loss=False,
    ),
    rollout=RolloutConfig(n=1, temperature=1.0, max_response_length=1024, max_batch_size=512),
    data=DataConfig(
        train_files=["data/gsm8k/train.parquet"], val_files=["data/gsm8k/test.parquet"],
        train_batch_size=512, val_batch_size=1319, max_prompt_length=512,
    ),
    algorithm=ALGORITHM,
    trainer=TrainerConfig(total_steps=200, val_every=20, output_dir="outputs/remax-gsm8k"),
)


def cpu() -> Config:
    """ReMax on the quickstart (``configs/quickstart.py``): the tiny model's SFT warm start, 2 CPU ranks."""
    cfg = load_config_file(Path(__file__).with_name("quickstart.py"))
    cfg.actor.optim = OptimConfig(lr=1e-4)  # a higher constant LR than the quickstart's: demos of 10-20 steps
    cfg.actor.use_kl_loss = False
    cfg.rollout.n = 4
    cfg.algorithm = ALGORITHM
    cfg.trainer.output_dir = "outputs/remax-cpu"
    return cfg
