"""The hand-built PPO micro-batch and loss the engine checks share (``tp_check.py``, ``megatron_check.py``): eight
rows of left-padded prompts and responses of uneven lengths, with old/reference log-probs and advantages, from a
seed; a clipped policy loss with a k3 KL term and an entropy bonus over them."""

import torch

from rlspmd.algorithms import AggArgs, entropy_bonus, kl_penalty, ppo_clip
from rlspmd.protocol import Batch

B, P, R = 8, 6, 10
LENGTHS = (10, 3, 7, 1, 10, 5, 2, 8)
TEMPERATURE = 0.9


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


def policy_loss(module, mb: Batch, agg: AggArgs) -> torch.Tensor:
    logp, entropy = module(mb["input_ids_BL"], mb["attention_mask_BL"], mb["position_ids_BL"], response_len=R,
                           temperature=TEMPERATURE)
    mask = mb["response_mask_BR"].float()
    pg, _ = ppo_clip(logp, mb["old_logprobs_BR"], mb["advantages_BR"], mask, agg=agg, clip_low=0.2, clip_high=0.2,
                     clip_ratio_c=3.0)
    kl = kl_penalty(logp, mb["ref_logprobs_BR"], kind="k3")
    return pg + 0.1 * agg(kl, mask) - 0.01 * entropy_bonus(entropy, mask, agg=agg)
