"""The MoE quickstart: the quickstart's GRPO run (``configs/quickstart.py``) with the tiny Qwen3-MoE, its experts
split over the 2 CPU ranks (expert parallel 2) and the rollout's routing replayed in training (R3).

    MODEL=moe bash scripts/quickstart.sh     # builds the model and data, runs the SFT warm start, then this

Each MoE layer's 8 experts are sharded 4 per rank (``mesh.actor_ep=2``): a token reaches its experts' rank by
``all_to_all`` in the forward and its gradient comes back the same way; attention, norms and embeddings stay
FSDP2-sharded over both ranks. The native rollout generates from its own copy of the weights (synced every step) and
records the experts each token went to; the old-log-prob pass and the update replay them (``actor.moe.router_replay
= R3``). ``moe/routing_agreement`` (1.0 under R3), ``moe/router_agreement``, ``moe/expert_load`` and
``actor/moe_aux_loss`` are logged every step (docs/moe.md).
"""

from rlspmd.config import (
    ActorConfig,
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    PPOClip,
    RolloutConfig,
    TrainerConfig,
)

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path="outputs/quickstart-moe-sft/hf"),
        optim=OptimConfig(lr=3e-5, warmup_steps=5),
        mini_batch_size=16,
        micro_batch_size=64,
        logprob_micro_batch_size=128,
        policy_loss=PPOClip(clip_ratio_high=0.28),
        kl_loss_coef=0.001,
        moe=MoEConfig(router_replay="R3"),
    ),
    mesh=MeshConfig(actor_ep=2),
    rollout=RolloutConfig(n=8, max_response_length=48, temperature=1.0),
    data=DataConfig(
        train_files=["data/arithmetic/train.parquet"],
        val_files=["data/arithmetic/test.parquet"],
        train_batch_size=32,
        val_batch_size=500,
        max_prompt_length=64,
    ),
    trainer=TrainerConfig(total_steps=40, val_every=10, output_dir="outputs/quickstart-moe"),
)
