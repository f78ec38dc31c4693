"""What every rollout engine shares: the interface and the layout of a generated batch.

An engine takes a Batch of left-padded prompts (``prompts_BP``, ``prompt_mask_BP`` plus per-sample
objects) and returns ``n`` samples per prompt, consecutive, with the training layout of
``rlspmd.protocol`` (``input_ids_BL = prompts_BP ++ responses_BR``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from rlspmd.protocol import Batch
from rlspmd.rollout.sampling import SamplingParams


class RolloutEngine(Protocol):
    def generate(self, prompts: Batch, params: SamplingParams, *, generator: torch.Generator) -> Batch: ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a full ``(HF name, tensor)`` stream (``rollout/weight_sync.py``); returns the bytes loaded."""

    def sleep(self) -> None:
        """Release memory until the next ``wake`` (may drop the weights: see ``holds_weights``)."""

    def wake(self) -> None: ...

    @property
    def holds_weights(self) -> bool:
        """Whether generate can run after ``wake`` without a weight load first."""

    def take_times(self) -> dict[str, float]:
        """Seconds spent in wake and sleep since the last call (``wake_s``, ``sleep_s``)."""


def assemble_rollout(
    batch: Batch, responses_BR: torch.Tensor, lengths_B: torch.Tensor, logprobs_BR: torch.Tensor, *, pad_id: int
) -> Batch:
    """Add the response tensors and the concatenated training layout to ``batch`` (the repeated prompts).

    ``responses_BR`` may be wider than needed; it is trimmed to the longest response. Tokens past each
    row's length are set to ``pad_id`` and masked out.
    """
    R = max(int(lengths_B.max()), 1) if len(lengths_B) else 1
    responses_BR = responses_BR[:, :R]
    logprobs_BR = logprobs_BR[:, :R]
    mask_BR = (torch.arange(R, device=responses_BR.device)[None] < lengths_B[:, None].to(responses_BR.device)).long()
    responses_BR = responses_BR.masked_fill(mask_BR == 0, pad_id)
    attention_mask_BL = torch.cat([batch["prompt_mask_BP"].long(), mask_BR], dim=1)
    position_ids_BL = (attention_mask_BL.cumsum(-1) - 1).clamp(min=0)
    return batch.set(
        responses_BR=responses_BR,
        response_mask_BR=mask_BR,
        rollout_logprobs_BR=logprobs_BR * mask_BR,
        input_ids_BL=torch.cat([batch["prompts_BP"], responses_BR], dim=1),
        attention_mask_BL=attention_mask_BL,
        position_ids_BL=position_ids_BL,
    )


TOKEN_ID_FIELDS = ("prompts_BP", "responses_BR", "input_ids_BL")
"""Fields holding token ids: padded with the pad token; every other tensor is padded with 0."""


def concat_rollouts(batches: list[Batch], *, pad_id: int) -> Batch:
    """Concatenate rollout batches whose prompt / response widths differ (rounds, ranks), re-padding each.

    Widths follow the layout of ``rlspmd.protocol``: ``_BP`` tensors are left-padded to the widest prompt,
    ``_BR`` tensors right-padded to the widest response, and each ``_BL`` tensor is split at its prompt width and
    padded on both sides. ``position_ids_BL`` is recomputed from the padded attention mask.
    """
    batches = [b for b in batches if len(b)]
    if not batches:
        raise ValueError("concat_rollouts needs at least one non-empty batch")
    P = max(b["prompts_BP"].shape[1] for b in batches)
    R = max(b["responses_BR"].shape[1] for b in batches)
    padded = []
    for b in batches:
        p, r = b["prompts_BP"].shape[1], b["responses_BR"].shape[1]
        tensors = {}
        for k, v in b.tensors.items():
            value = pad_id if k in TOKEN_ID_FIELDS else 0
            if k.endswith("_BP"):
                v = _pad(v, left=P - p, right=0, value=value)
            elif k.endswith("_BR"):
                v = _pad(v, left=0, right=R - r, value=value)
            elif k.endswith("_BL"):
                v = torch.cat([_pad(v[:, :p], left=P - p, right=0, value=value), _pad(v[:, p:], left=0, right=R - r, value=value)], 1)
            tensors[k] = v
        padded.append(Batch(tensors, b.objects))
    out = Batch.concat(padded)
    if "position_ids_BL" in out:
        out.set(position_ids_BL=(out["attention_mask_BL"].cumsum(-1) - 1).clamp(min=0))
    return out


def _pad(x: torch.Tensor, *, left: int, right: int, value) -> torch.Tensor:
    if not left and not right:
        return x
    shape = list(x.shape)
    parts = []
    if left:
        parts.append(x.new_full([shape[0], left, *shape[2:]], value))
    parts.append(x)
    if right:
        parts.append(x.new_full([shape[0], right, *shape[2:]], value))
    return torch.cat(parts, 1)
