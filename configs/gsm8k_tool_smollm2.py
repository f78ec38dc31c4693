"""GRPO with a tool on a real pretrained model: SmolLM2-135M-Instruct on GSM8K, submitting answers to the GSM8K
answer-check tool (``calc_gsm8k_reward``: the model hears "correct" / "incorrect" and may try again).

    python scripts/models/smollm2.py                                               # the HF dir, offline (once)
    python scripts/data/gsm8k_multiturn.py --gsm-symbolic --out-dir data/gsm8k_tool  # or --input ~/gsm8k (a local copy)
    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/gsm8k_tool_smollm2.py                  # a GPU node
    python -m rlspmd.train --config configs/gsm8k_tool_smollm2.py --trainer.total-steps 1 \\
        --data.train-batch-size 2 --actor.mini-batch-size 2 --rollout.n 4 --data.val-batch-size 4 \\
        --data.max-val-samples 4 --rollout.max-response-length 256    # CPU, slowly (tens of minutes on 2 shared cores)

Every sample is a conversation (``rollout.agent``): the model reasons, calls
``<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>``, reads the verdict as a
``tool`` turn, and ends with ``#### N``; at most ``max_turns`` assistant turns. The score is the rule check of the final
``#### N`` (``reward.rule_weight``) plus the agent's rewards (``reward.agent_weight``): the tool's score of the last
submitted answer (1 if right) and -0.05 per submission that does not improve on the previous one (verl's values).
Only the model's own tokens are trained on (``loss_mask_BR``); the tool turns are masked out.

SmolLM2's chat template ignores the ``tools`` argument, so ``rollout.agent.tool_prompt="system"`` writes the tool schema
and the ``<tool_call>`` syntax into the system message (``rlspmd/agent/chat.py``); with a model whose template renders
tools (Qwen2.5, Llama 3.1), drop that line. The data's rows are verl's multi-turn schema
(``extra_info.tools_kwargs``), so verl's own GSM8K multi-turn parquet files work here unchanged.

The single-turn recipe (``configs/gsm8k_smollm2.py``, whose ``MODEL`` line picks the model; its optimiser, KL and
batch sizes are kept) with the tool, the conversation's lengths and the multi-turn data.
"""

from pathlib import Path

from rlspmd.config import AgentConfig, load_config_file

BASE = Path(__file__).with_name("gsm8k_smollm2.py")  # the single-turn recipe: its MODEL line picks the model

config = load_config_file(BASE)
config.actor.micro_batch_size = 8  # conversations are about twice as long as single answers
config.actor.logprob_micro_batch_size = 16
# a conversation: reasoning (~200 tokens) + call (~25) + verdict turn (~12) + final answer; 768 leaves room to retry
config.rollout.max_response_length = 768
config.rollout.agent = AgentConfig(
    tools=["calc_gsm8k_reward"], tool_prompt="system", max_turns=3, max_tool_response_chars=256
)
config.data.train_files = ["data/gsm8k_tool/train.parquet"]
config.data.val_files = ["data/gsm8k_tool/test.parquet"]
config.data.max_prompt_length = 768  # system prompt with the tool schema (~260 SmolLM2 tokens) + the question (<200)
config.trainer.output_dir = "outputs/gsm8k_tool_smollm2"
