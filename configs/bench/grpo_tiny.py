"""Benchmark workload (issue: throughput): one fixed GRPO step, timed. Not a training recipe.

    python scripts/bench/grpo_workload.py --which grpo_tiny          # model + prompts (deterministic, seconds)
    python -m rlspmd.train --config configs/bench/grpo_tiny.py       # last line: JSON with sec_per_step

A random-init Qwen2 (hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 688, vocab 8192, tied, fp32);
4 prompts x 4 samples = 16 sequences per step; 27-token prompts; exactly 64 sampled tokens per completion (EOS
never sampled); temperature 1.0; KL (k3) to the frozen reference with coefficient 0.04 as a loss term; one
optimiser update per step (the mini-batch is the whole batch). The random model earns no reward, so every
advantage is 0, and the step still does all the work: generation, reference and policy forwards, backward,
optimiser step. ``scripts/bench/trl_grpo.py`` runs the same workload through TRL's GRPOTrainer.
"""

from rlspmd.config import (
    NativeConfig,
    ActorConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
)


def workload(
    model: str, name: str, steps: int = 6, data: str = "data/bench/prompts.jsonl", prompt_tokens: int = 27
) -> Config:
    return Config(
        actor=ActorConfig(
            model=ModelConfig(path=model),
            optim=OptimConfig(lr=1e-6, grad_clip=1.0),
            mini_batch_size=4,
            micro_batch_size=16,
            logprob_micro_batch_size=16,
            use_kl_loss=True,
            kl_loss_coef=0.04,
            kl_loss_type="k3",
        ),
        rollout=RolloutConfig(
            n=4, max_response_length=64, temperature=1.0, ignore_eos=True, engine=NativeConfig(max_batch_size=16)
        ),
        data=DataConfig(
            train_files=[data],
            val_files=[data],
            train_batch_size=4,
            max_prompt_length=prompt_tokens,
            overlong_prompts="error",
            shuffle=False,
        ),
        trainer=TrainerConfig(
            total_steps=steps,
            val_before_train=False,
            val_every=0,
            loggers=["jsonl"],
            output_dir=f"outputs/bench/{name}",
            print_summary_json=True,
        ),
        checkpoint=CheckpointConfig(save_final=False, resume="none"),
    )


config = workload("models/bench-256", "grpo_tiny")
