"""The hand-built PPO micro-batch the engine checks share (``tp_check.py``, ``megatron_check.py``): eight rows of
left-padded prompts and responses of uneven lengths, with old/reference log-probs and advantages, from a seed."""

import torch

from rlspmd.protocol import Batch

B, P, R = 8, 6, 10
LENGTHS = (10, 3, 7, 1, 10, 5, 2, 8)


def global_batch(vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    for b in range(B):
        prompt_mask[b, : b % 3] = 0  # left padding
    response_mask = (torch.arange(R)[None] < torch.tensor(LENGTHS)[:, None]).long()
    prompts = torch.randint(3, vocab, (B, P), generator=g) * prompt_mask
    responses = torch.randint(3, vocab, (B, R), generator=g) * response_mask
    attn = torch.cat([prompt_mask, response_mask], 1)
    return Batch({
        "input_ids_BL": torch.cat([prompts, responses], 1),
        "attention_mask_BL": attn,
        "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses_BR": responses,
        "response_mask_BR": response_mask,
        "loss_mask_BR": response_mask,
        "old_logprobs_BR": -torch.rand(B, R, generator=g) * 3 - 2,
        "ref_logprobs_BR": -torch.rand(B, R, generator=g) * 3 - 2,
        "advantages_BR": torch.randn(B, R, generator=g) * response_mask,
    })
