"""Where a rollout engine's weights come from: one abstraction, ``WeightSource``, for every placement.

A rollout role asks its source for the weights after each actor update (``stream()``) and hands them to its engine
(``RolloutEngine.update_weights``):

* ``InPlaceWeights`` — colocated native engine in the actor's compute dtype: nothing to load. The engine reads the
  actor's parameters where they are, gathered in place for the duration of a generation (``model()``): no copy, and
  always the current weights, so the sync is free.
* ``StreamedWeights`` — colocated, any other engine or dtype: every rank gathers the actor's weights unit by unit
  (``TrainingEngine.weight_stream``) and loads its own engine.
* ``BridgedWeights`` — split placement, on the rollout ranks: the units the actor's first rank broadcasts
  (``rollout/weight_sync.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from rlspmd.engines.base import InPlaceEngine, WeightStream
from rlspmd.rollout.weight_sync import WeightBridge


class WeightSource(Protocol):
    in_place: bool
    """The engine reads the actor's weights where they are: nothing ever needs loading."""

    def stream(self) -> Iterable[tuple[str, torch.Tensor]] | None:
        """The full weights as ``(HF name, tensor)`` to load, or None when the engine reads them in place."""

    def stats(self) -> dict[str, float]:
        """``weight_sync/*`` byte counts of the last stream on this rank."""


class InPlaceWeights:
    in_place = True

    def __init__(self, engine: InPlaceEngine):
        self.engine = engine

    def model(self) -> AbstractContextManager[nn.Module]:
        """The actor's HF model with its parameters gathered in place, for the duration of a generation."""
        return self.engine.gathered_hf_model()

    def stream(self) -> None:
        return None

    def stats(self) -> dict[str, float]:
        return {}


class StreamedWeights:
    in_place = False

    def __init__(self, stream: WeightStream):
        self.source = stream

    def stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        return iter(self.source)

    def stats(self) -> dict[str, float]:
        return self.source.stats()


class BridgedWeights:
    in_place = False

    def __init__(self, bridge: WeightBridge):
        self.bridge = bridge

    def stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.bridge.receive()

    def stats(self) -> dict[str, float]:
        return {"weight_sync/broadcast_bytes": float(self.bridge.received_bytes)}
