"""Reward model: a frozen HF sequence classifier on a training engine scores prompt + response (part of the reward
role, ``roles/reward.py``).

When the reward model's tokenizer or chat template differs from the actor's, the actor's token ids mean nothing
to it: the conversation is re-rendered as text (the prompt's chat messages plus the decoded response as the
assistant turn) with the reward model's own template and tokenizer. When both agree, the actor's
``input_ids_BL`` (prompt + response, as generated) are scored directly.
"""

from __future__ import annotations

import torch

from rlspmd.config import RewardModelConfig
from rlspmd.engines.base import TrainingEngine
from rlspmd.protocol import Batch, position_ids
from rlspmd.distributed.micro_batches import forward_micro_batches


def same_tokenization(a, b) -> bool:
    """Do two tokenizers turn the same conversation into the same ids (same vocabulary and chat template)?"""
    return a.chat_template == b.chat_template and a.get_vocab() == b.get_vocab()


def render_conversations(tokenizer, prompt_messages: list[list[dict]], responses: list[str]) -> Batch:
    """Left-padded ``input_ids_BL`` / ``attention_mask_BL`` / ``position_ids_BL`` of each prompt + response,
    rendered with ``tokenizer``'s chat template (the response is the final assistant turn)."""
    texts = [
        tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
        for messages, response in zip(prompt_messages, responses)
    ]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    L = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), L), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(ids), L, dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, L - len(x) :] = torch.tensor(x)
        mask[i, L - len(x) :] = 1
    return Batch({"input_ids_BL": input_ids, "attention_mask_BL": mask, "position_ids_BL": position_ids(mask)})


class RewardModel:
    def __init__(
        self, cfg: RewardModelConfig, *, engine: TrainingEngine, tokenizer, actor_tokenizer, device: torch.device
    ):
        """``tokenizer``: the reward model's own (its chat template renders the conversation when it differs from
        the actor's)."""
        self.cfg, self.engine, self.tokenizer, self.device = cfg, engine, tokenizer, device
        self.rerender = not same_tokenization(tokenizer, actor_tokenizer)
        if self.rerender and not tokenizer.chat_template:
            raise ValueError(
                f"reward.model.tokenizer_path: the reward model's tokenizer ({cfg.tokenizer_path or cfg.path}) "
                "differs from the actor's and has no chat template to render the conversation with"
            )

    @torch.no_grad()
    def __call__(self, batch: Batch) -> Batch:
        """Adds ``rm_scores_B`` (float32), the reward model's raw score of each sample."""
        if self.rerender:
            inputs = render_conversations(self.tokenizer, batch["prompt_messages"], batch["response_text"]).to(
                self.device
            )
        else:
            inputs = batch
        scores_B = forward_micro_batches(
            inputs,
            lambda mb: self.engine.module(mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"]),
            micro_batch_size=self.cfg.micro_batch_size,
            max_tokens=self.cfg.max_tokens_per_micro_batch,
            mesh=self.engine.mesh,
        )
        return batch.set(rm_scores_B=scores_B)
