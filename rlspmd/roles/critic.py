"""Critic role. ``NoCritic`` stands in for critic-free algorithms (GRPO family): it does nothing."""

from __future__ import annotations

from rlspmd.distributed.dispatch import MetricBuffer
from rlspmd.protocol import Batch


class NoCritic:
    def values(self, batch: Batch) -> Batch:
        return batch

    def update(self, batch: Batch) -> MetricBuffer:
        return MetricBuffer()
