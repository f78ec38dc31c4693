"""What every rollout engine shares: the interface and the layout of a generated batch.

An engine takes a Batch of left-padded prompts (``prompts_BP``, ``prompt_mask_BP`` plus per-sample
objects) and returns ``n`` samples per prompt, consecutive, with the training layout of
``rlspmd.protocol`` (``input_ids_BL = prompts_BP ++ responses_BR``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from rlspmd.protocol import Batch, position_ids
from rlspmd.rollout.continuous import RequestSource
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

    def serve(self, source: RequestSource, params: SamplingParams, *, max_len: int, max_requests: int) -> dict:
        """Request-level generation for the agent loop: run ``source``'s requests (each a conversation's next turn),
        at most ``max_requests`` at a time and ``max_len`` tokens per sequence, until it has none left; returns
        counts (decode steps, prefills, tokens, idle waits)."""


def assemble_rollout(
    batch: Batch,
    responses_BR: torch.Tensor,
    lengths_B: torch.Tensor,
    logprobs_BR: torch.Tensor,
    *,
    pad_id: int,
    loss_mask_BR: torch.Tensor | None = None,
) -> Batch:
    """Add the response tensors and the concatenated training layout to ``batch`` (the repeated prompts).

    ``responses_BR`` may be wider than needed; it is trimmed to the longest response. Tokens past each
    row's length are set to ``pad_id`` and masked out. ``loss_mask_BR``: which response tokens the model generated
    (multi-turn rollouts); None: all of them (a single turn).
    """
    R = max(int(lengths_B.max()), 1) if len(lengths_B) else 1
    responses_BR = responses_BR[:, :R]
    logprobs_BR = logprobs_BR[:, :R]
    mask_BR = (torch.arange(R, device=responses_BR.device)[None] < lengths_B[:, None].to(responses_BR.device)).long()
    responses_BR = responses_BR.masked_fill(mask_BR == 0, pad_id)
    attention_mask_BL = torch.cat([batch["prompt_mask_BP"].long(), mask_BR], dim=1)
    return batch.set(
        responses_BR=responses_BR,
        response_mask_BR=mask_BR,
        loss_mask_BR=mask_BR.clone() if loss_mask_BR is None else loss_mask_BR[:, :R] * mask_BR,
        rollout_logprobs_BR=logprobs_BR * mask_BR,
        input_ids_BL=torch.cat([batch["prompts_BP"], responses_BR], dim=1),
        attention_mask_BL=attention_mask_BL,
        position_ids_BL=position_ids(attention_mask_BL),
    )
