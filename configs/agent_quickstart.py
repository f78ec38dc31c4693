"""The agent quickstart: GRPO with a calculator tool on 3-digit arithmetic, 2 CPU ranks.

    bash scripts/agent_quickstart.sh        # all four steps below, then the run's summary

    python scripts/models/build_tiny.py --out models/tiny-tools --tools
    python scripts/data/agent_arithmetic.py --out-dir data/agent_arithmetic
    torchrun --nproc-per-node 2 -m rlspmd.sft --config configs/sft_agent_quickstart.py
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/agent_quickstart.py

Starts from the SFT warm start (``configs/sft_agent_quickstart.py``: 30% of its demonstrations call the calculator,
the rest answer in their head). Every sample is a conversation: the model may emit
``<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>``, the result comes back as a
``tool`` turn, and the conversation goes on until an answer without a call (``rollout.agent.max_turns`` at most). The
reward is the task's exact-answer check on the final text (``#### N``); only the model's own tokens are trained on
(``loss_mask_BR``). What GRPO should find from reward alone: calling the calculator beats mental arithmetic, so
``agent/tool_call_rate`` and ``val/agent/tool_call_rate`` rise with the validation accuracy (``val/score``).
"""

from rlspmd.config import (
    ActorConfig,
    AgentConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PPOClip,
    RolloutConfig,
    TrainerConfig,
)

config = Config(
    actor=ActorConfig(
        model=ModelConfig(path="outputs/agent-quickstart-sft/hf"),
        optim=OptimConfig(lr=5e-5, warmup_steps=3),
        mini_batch_size=16,
        micro_batch_size=64,
        logprob_micro_batch_size=128,
        policy_loss=PPOClip(clip_ratio_high=0.28),
        kl_loss_coef=0.001,
    ),
    # a conversation: call (~25 tokens) + tool turn (~15) + answer (~10); 96 leaves room for a second call
    rollout=RolloutConfig(
        n=8, max_response_length=96, temperature=1.0, agent=AgentConfig(tools=["calculator"], max_turns=3)
    ),
    data=DataConfig(
        train_files=["data/agent_arithmetic/train.parquet"],
        val_files=["data/agent_arithmetic/test.parquet"],
        train_batch_size=16,
        val_batch_size=200,
        max_prompt_length=96,
    ),
    trainer=TrainerConfig(total_steps=20, val_every=5, output_dir="outputs/agent-quickstart"),
)
