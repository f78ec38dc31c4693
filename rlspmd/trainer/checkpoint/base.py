"""The checkpoint contract: what the trainer asks of a checkpoint store, written down (``CheckpointStore``).

The trainer side (``checkpointing.py``: which objects a checkpoint holds, when to save, when to stop) talks to its
store through these five methods only, so a different store (another file format, object storage, an asynchronous
writer) is one class that offers them; the builder (``trainer/build.py``) and ``rlspmd.sft`` are the places that pick
it. ``Checkpointer`` (DCP files under ``checkpoint.dir``) is the one this package provides.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


class CheckpointError(RuntimeError):
    pass


class CheckpointStore(Protocol):
    """Where checkpoints live and how they are written and read. Every method is collective over the ranks that hold
    trainable state, and raises the same error on every one of them, so no rank is left waiting in a collective.

    A checkpoint is named by a ``Path`` (a directory here; another store may treat it as a key). ``state`` maps a name
    to a ``Stateful`` (the trained engines, ``trainer``, ``rng``, ``pipeline``: ``checkpointing.py``); a store must
    give each object back exactly what its ``state_dict()`` returned at save time, on any number of ranks.
    """

    def prepare(self) -> Path | None:
        """Check that the store can be written and pick the checkpoint to resume from (``checkpoint.resume``), or
        None for a fresh start. Called once, before any model loads, so a bad setting fails in seconds."""
        ...

    def due(self, step: int, *, last: bool) -> bool:
        """Whether to save after ``step`` (``last``: the run's final step) when nothing asks the run to stop."""
        ...

    def save(self, step: int, state: dict[str, Stateful], *, meta: dict, write_files: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step`` atomically (a crash in the middle leaves the previous one the newest): the state,
        ``meta`` (JSON: what the run records about itself), and whatever ``write_files(dir)`` adds (model config,
        tokenizer, HF export). Returns the new checkpoint."""
        ...

    def load(
        self,
        path: Path,
        state: dict[str, Stateful],
        *,
        engines: dict[str, dict[str, torch.Size]],
        components: list[str],
    ) -> dict:
        """Restore ``state`` from ``path`` and return its ``meta``; before reading any weights, refuse (naming the
        mismatch) a checkpoint that does not fit: ``engines`` (role -> parameter name -> shape) and the trainer
        ``components`` whose state it must hold. Nothing read may run code."""
        ...

    def saved_tensors(self, path: Path, *, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of every tensor of ``path`` under the key ``prefix`` (removed from the keys), read on one
        rank: for state whose shapes only the checkpoint knows (asynchronous RL's in-flight batches)."""
        ...
