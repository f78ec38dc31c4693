"""Reward shaping applied to training rewards after scoring.

``overlong_penalty`` is DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv 2503.14476, eq. 13): with a response budget ``L_max`` and a buffer of ``L_cache``
tokens at its end,

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                   if |y| > L_max

times ``penalty_factor``, added to the task reward. Responses cannot exceed the budget here (generation stops at
it), so the last case is reached exactly at ``|y| = L_max``. Validation reports the unshaped score.
"""

from __future__ import annotations

import torch

from rlspmd.rewards.config import OverlongBufferConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch


def overlong_penalty(
    lengths_B: torch.Tensor, *, max_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """Per-sample penalty (<= 0, float32) for response lengths ``lengths_B`` (valid tokens, EOS included)."""
    expected = max_length - buffer_len
    exceed = lengths_B.float() - expected
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


class OverlongShaping:
    """Adds ``overlong_penalty_B`` and folds it into ``scores_B``."""

    def __init__(self, cfg: OverlongBufferConfig, *, max_response_length: int):
        if not 0 < cfg.len <= max_response_length:
            raise ValueError(
                f"reward.overlong_buffer.len={cfg.len} must be in "
                f"(0, rollout.max_response_length={max_response_length}]"
            )
        if cfg.penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor must be >= 0, got {cfg.penalty_factor}")
        self.cfg, self.max_length = cfg, max_response_length

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        lengths = batch["response_mask_BR"].sum(-1)
        penalty = overlong_penalty(
            lengths, max_length=self.max_length, buffer_len=self.cfg.len, penalty_factor=self.cfg.penalty_factor
        )
        return batch.set(overlong_penalty_B=penalty, scores_B=batch["scores_B"] + penalty)


class NoShaping:
    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch
