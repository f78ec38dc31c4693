"""GPU benchmark workload ``q05`` (issue 12): one fixed GRPO step on one GPU, timed. Not a training recipe.

    python scripts/bench/grpo_workload.py --which grpo_q05         # model + prompts (deterministic)
    python -m rlspmd.train --config configs/bench/grpo_q05.py      # last line: JSON with sec_per_step
    python scripts/bench/gpu_suite.py                              # everything, against TRL (one command)

A random-init Qwen2 causal LM with Qwen2.5-0.5B's body and the bench vocabulary: hidden 896, 24 layers, 14 heads / 2
KV heads, intermediate 4864, vocab 8192, max positions 1024, tied embeddings, fp32 master weights (365 M parameters),
bf16 compute (``actor.engine.param_dtype=auto`` on CUDA). 32 prompts x 8 samples = 256 sequences per step; 27-token
prompts; exactly 256 sampled tokens (EOS never sampled); temperature 1.0; k3 KL loss to the frozen reference with
coefficient 0.04; one optimiser update per step (the mini-batch is the whole batch; the update's forward provides the
old log-probs); all work done (the random model earns no reward, every advantage is 0, and nothing is skipped).
Micro-batches: 32 sequences per update forward/backward (like TRL's 32 x 8 accumulation), 64 per reference forward.

``smoke``: the same shape of run on a tiny model (``models/bench-tiny``) and a few tokens, for CPU smoke tests.
"""

from rlspmd.config import (
    NativeConfig,
    ActorConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RolloutConfig,
    TrainerConfig,
)


def workload(
    model: str,
    name: str,
    *,
    prompts: int = 32,
    samples: int = 8,
    new_tokens: int = 256,
    micro: int = 32,
    ref_micro: int = 64,
    steps: int = 4,
    data: str = "data/bench/prompts.jsonl",
) -> Config:
    return Config(
        actor=ActorConfig(
            model=ModelConfig(path=model),
            optim=OptimConfig(lr=1e-6, grad_clip=1.0),
            mini_batch_size=prompts,
            micro_batch_size=micro,
            logprob_micro_batch_size=ref_micro,
            use_kl_loss=True,
            kl_loss_coef=0.04,
            kl_loss_type="k3",
        ),
        ref=RefConfig(logprob_micro_batch_size=ref_micro),
        rollout=RolloutConfig(
            n=samples,
            max_response_length=new_tokens,
            temperature=1.0,
            ignore_eos=True,
            engine=NativeConfig(max_batch_size=prompts * samples),
        ),
        data=DataConfig(
            train_files=[data],
            val_files=[data],
            train_batch_size=prompts,
            max_prompt_length=27,
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


config = workload("models/bench-q05", "grpo_q05")
smoke = workload(
    "models/bench-tiny",
    "grpo_q05_smoke",
    prompts=4,
    samples=2,
    new_tokens=16,
    micro=4,
    ref_micro=8,
    steps=2,
    data="data/bench/smoke_prompts.jsonl",
)
