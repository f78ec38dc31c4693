"""The optimal token baseline (OTB): a per-token baseline for a group's returns, weighted by each path's variance.

verl: ``compute_optimal_token_baseline_advantage`` and its multi-turn variant
``compute_multi_turn_optimal_token_baseline_advantage`` (``verl/trainer/ppo/core_algos.py``). For the samples of one
prompt and each position t,

    B_t = sum_i G_{i,t} W_{i,t} / (sum_i W_{i,t} + eps),      A_{i,t} = G_{i,t} - B_t,

where G_{i,t} is the reward-to-go of sample i from token t and W_{i,t} = sum_{j <= t} w_{i,j} the cumulative
path-variance proxy of its tokens so far, w_j = 1 - 2 pi_j + sum_v pi(v)^2 = ||onehot(y_j) - pi||^2 (the squared norm
of the score function of the softmax at token j): pi_j is the probability of the sampled token under the policy that
generated it, sum_v pi(v)^2 the sum of the squared probabilities of the whole vocabulary there (the trainer produces
it in the old-log-prob forward, ``rlspmd.models.logprobs``). With truncated importance weights rho_j, w_j is scaled by
rho_j^2.

The two variants differ only in which tokens of a group share a baseline: the single-turn one aligns samples by
response position; the multi-turn one by the index among the model's own tokens (the ``mask_BT`` tokens: tool results
inside a response are skipped, so the k-th token the model wrote is compared with the k-th of the others). With
responses whose mask has no holes the two are equal. Both give a group of one sample (a prompt with a single
response; in the multi-turn variant, counting only responses with a token) baseline 0. ``handle_zero_tail``: in a
group whose longest response is strictly longer than every other, that response's baseline is 0 past the second
longest's length (its tail has nothing to compare with; verl's default is off for the single-turn variant and on for
the multi-turn one).

Pure function, no autograd, shapes as in ``advantages.py`` (``_BT`` per response token, ``group_ids_B`` integer ids).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlspmd.algorithms.advantages import _check_BT, _groups


@torch.no_grad()
def optimal_token_baseline(
    token_rewards_BT: Tensor,
    mask_BT: Tensor,
    group_ids_B: Tensor,
    old_logprobs_BT: Tensor,
    sum_pi_squared_BT: Tensor,
    *,
    multi_turn: bool = False,
    handle_zero_tail: bool = False,
    weights_BT: Tensor | None = None,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """OTB advantages and the reward-to-go (module docstring).

    Args:
        token_rewards_BT: (B, T) per-token rewards (the score on the last token, minus any KL penalty).
        mask_BT: (B, T) the model's tokens (1.0) vs padding and tool / observation tokens (0.0).
        group_ids_B: (B,) integer prompt ids.
        old_logprobs_BT: (B, T) log-probs of the sampled tokens under the behaviour policy.
        sum_pi_squared_BT: (B, T) sum over the vocabulary of the squared probabilities at each position.
        multi_turn: align a group's samples by their k-th model token instead of by position (verl's
            ``tir_optimal_token_baseline``).
        handle_zero_tail: zero the baseline of a group's unique longest response past the second longest's length.
        weights_BT: (B, T) truncated importance weights, or None.
        eps: added to the baseline's denominator.

    Returns:
        ``(advantages_BT, returns_BT)``: advantages 0 at masked positions; returns the reward-to-go.
    """
    for name, x in (("token_rewards_BT", token_rewards_BT), ("old_logprobs_BT", old_logprobs_BT)):
        _check_BT(name, x, mask_BT)
    _check_BT("sum_pi_squared_BT", sum_pi_squared_BT, mask_BT)
    B, T = mask_BT.shape
    mask = mask_BT.to(torch.float32 if token_rewards_BT.dtype != torch.float64 else torch.float64)
    rewards = token_rewards_BT.to(mask.dtype)
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1.0 - 2.0 * old_logprobs_BT.to(mask.dtype).exp() + sum_pi_squared_BT.to(mask.dtype)
    if weights_BT is not None:
        _check_BT("weights_BT", weights_BT, mask_BT)
        w = w * weights_BT.to(mask.dtype).square()
    w_cum = (w * mask).cumsum(-1)

    valid = mask > 0
    lengths_B = valid.sum(-1)
    # Where each token sits in its group's per-step statistics: its position, or its index among the model's tokens.
    step_BT = valid.long().cumsum(-1) - 1 if multi_turn else torch.arange(T, device=mask.device).expand(B, T)
    inv_B, G = _groups(group_ids_B, B)
    counted_B = lengths_B > 0 if multi_turn else torch.ones_like(lengths_B, dtype=torch.bool)
    n_G = torch.zeros(G, dtype=torch.long, device=mask.device).index_add_(0, inv_B, counted_B.long())

    cell_BT = (inv_B[:, None] * T + step_BT).clamp(min=0)  # (group, step) flattened; masked tokens add 0
    num = torch.zeros(G * T, dtype=mask.dtype, device=mask.device)
    den = torch.zeros_like(num)
    num.index_add_(0, cell_BT[valid], (returns * w_cum)[valid])
    den.index_add_(0, cell_BT[valid], w_cum[valid])
    baseline_BT = (num / (den + eps))[cell_BT]
    baseline_BT = torch.where((n_G > 1)[inv_B][:, None], baseline_BT, 0.0)

    if handle_zero_tail:
        baseline_BT = _zero_tails(baseline_BT, step_BT, lengths_B, inv_B, G, counted_B, n_G)
    advantages = torch.where(valid, returns - baseline_BT, 0.0)
    return advantages, returns


def _zero_tails(
    baseline_BT: Tensor, step_BT: Tensor, lengths_B: Tensor, inv_B: Tensor, G: int, counted_B: Tensor, n_G: Tensor
) -> Tensor:
    """In each group of two or more whose longest response is the only one of its length, that response's baseline is
    0 from the second longest's length on."""
    lengths = torch.where(counted_B, lengths_B, -1)
    longest_G = torch.full((G,), -1, dtype=lengths.dtype, device=lengths.device).scatter_reduce_(
        0, inv_B, lengths, reduce="amax"
    )
    is_longest_B = counted_B & (lengths == longest_G[inv_B])
    n_longest_G = torch.zeros(G, dtype=torch.long, device=lengths.device).index_add_(0, inv_B, is_longest_B.long())
    others = torch.where(is_longest_B, -1, lengths)
    second_G = torch.full((G,), -1, dtype=lengths.dtype, device=lengths.device).scatter_reduce_(
        0, inv_B, others, reduce="amax"
    )
    unique_B = is_longest_B & (n_longest_G == 1)[inv_B] & (n_G > 1)[inv_B]
    tail_BT = unique_B[:, None] & (step_BT >= second_G[inv_B][:, None])
    return torch.where(tail_BT, 0.0, baseline_BT)
