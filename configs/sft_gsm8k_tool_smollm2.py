"""Warm start for the GSM8K tool recipe: SmolLM2-135M-Instruct fine-tuned on conversations that reason, submit the
answer to ``calc_gsm8k_reward``, read "correct" and end with ``#### N`` (``scripts/data/gsm8k_tool_sft.py``).

    python scripts/models/smollm2.py
    python scripts/data/gsm8k_multiturn.py --gsm-symbolic --num-train 2000 --num-test 200 --out-dir data/gsm8k_tool
    python scripts/data/gsm8k_tool_sft.py --input data/gsm8k_tool/train.parquet --out data/gsm8k_tool/sft.parquet
    torchrun --nproc-per-node 2 -m rlspmd.sft --config configs/sft_gsm8k_tool_smollm2.py
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/gsm8k_tool_smollm2.py \\
        --actor.model.path outputs/gsm8k-tool-smollm2-sft/hf ...        # docs/smollm2.md: the CPU overrides

Untuned, the model made no tool calls (docs/agents.md): GRPO had nothing to reinforce. The demonstrations render the
tools exactly as the RL run does (``data.tools`` + ``data.tool_prompt="system"``: SmolLM2's template ignores ``tools``,
so the schema and the ``<tool_call>`` syntax go into the system message), and the loss covers the two assistant turns
only. The exported tokenizer (``outputs/gsm8k-tool-smollm2-sft/hf``) keeps that rendering for the RL run. A short warm
start on purpose (100 steps of 16 conversations): the point is the call format, not GSM8K itself, which GRPO is for.
"""

from rlspmd.config import ModelConfig, OptimConfig, SFTConfig, SFTDataConfig

MODEL = "~/.cache/rlspmd/smollm2-135m-instruct"  # the RL config's model

config = SFTConfig(
    model=ModelConfig(path=MODEL),
    optim=OptimConfig(lr=2e-5, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1, grad_clip=1.0),
    # prompt (system with the tool schema ~260 SmolLM2 tokens, question < 200)
    # + solution (< 300) + call + verdict + answer
    data=SFTDataConfig(
        train_files=["data/gsm8k_tool/sft.parquet"],
        messages_key="messages",
        tools=["calc_gsm8k_reward"],
        tool_prompt="system",
        batch_size=16,
        max_length=1024,
    ),
    micro_batch_size=4,
    total_steps=100,
    log_every=10,
    output_dir="outputs/gsm8k-tool-smollm2-sft",
)
