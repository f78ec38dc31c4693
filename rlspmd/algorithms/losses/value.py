"""The critic's clipped value loss and the entropy bonus: pure functions (not picked by name)."""

from __future__ import annotations

import torch
from torch import Tensor

from rlspmd.algorithms.aggregation import AggArgs
from rlspmd.algorithms.losses.common import check_shapes, masked_mean


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_range: float | None,
    agg: AggArgs,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).

    The value clipping of the PPO reference implementation (OpenAI baselines; Schulman et al. 2017, arXiv
    1707.06347): the new value may not move more than `clip_range` from the rollout's value to lower the loss.
    `clip_range=None` disables it (plain 0.5 (v - R)^2).

    Args:
        values_BT: (B, T) current critic values, carrying gradient.
        old_values_BT: (B, T) critic values at rollout time (constant).
        returns_BT: (B, T) targets, e.g. `gae(...)[1]` (constant).
        mask_BT: (B, T) response mask.
        clip_range: c above, > 0, or None.
        agg: aggregation settings.

    Returns:
        `(loss, metrics)`: metrics `vf_clip_frac` (fraction of valid tokens where the clipped term was the larger,
        i.e. the gradient was cut).
    """
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"value_loss: clip_range must be > 0 or None, got {clip_range}")
    check_shapes(mask_BT, values_BT=values_BT, old_values_BT=old_values_BT, returns_BT=returns_BT)
    old_values_BT, returns_BT = old_values_BT.detach(), returns_BT.detach()
    valid_BT = mask_BT > 0

    unclipped_BT = (values_BT - returns_BT).square()
    if clip_range is None:
        loss_BT = 0.5 * unclipped_BT
        clip_frac = torch.zeros((), device=values_BT.device)
    else:
        clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_range, clip_range)
        clipped_BT = (clipped_values_BT - returns_BT).square()
        loss_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT)
        clip_frac = masked_mean((clipped_BT > unclipped_BT).float(), valid_BT)
    return agg(loss_BT, mask_BT), {"vf_clip_frac": clip_frac}


def entropy_bonus(entropy_BT: Tensor, mask_BT: Tensor, *, agg: AggArgs) -> Tensor:
    """Aggregated per-token policy entropy, to be SUBTRACTED from the loss: `loss - coef * entropy_bonus(...)`.

    Args:
        entropy_BT: (B, T) entropy of the policy's next-token distribution at each response position (carries
            gradient when the bonus is trained on).
        mask_BT: (B, T) response mask.
        agg: aggregation settings (use the policy loss's, so both are normalised alike).

    Returns:
        0-dim tensor `agg(entropy_BT, mask_BT)`.
    """
    check_shapes(mask_BT, entropy_BT=entropy_BT)
    return agg(entropy_BT, mask_BT)
