"""The trainer's part of a checkpoint, encoded as data only (so that loading it cannot run code): its progress as one
JSON string (``TrainerState``), every rank's RNG states as tensors (``RNGState``), and asynchronous RL's in-flight
batches as tensors (``InFlightBatches``). Each is a ``Stateful`` under one key of the checkpoint's explicit dict
(``checkpointing.py``); ``decode_*`` inverts ``encode_*`` exactly, so a resume sees exactly what was saved.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from rlspmd.distributed.runtime import rng_state, set_rng_state
from rlspmd.protocol import Batch
from rlspmd.trainer.checkpoint.base import CheckpointError

PIPELINE = "pipeline"
"""The key of asynchronous RL's in-flight batches (``InFlightBatches``): not a trained role."""
OBJECTS = "objects_json"
"""A batch's per-sample objects in a checkpoint: their JSON text as a uint8 tensor (loading it runs no code)."""


def to_json_text(value, *, what: str) -> str:
    """``value`` as JSON text, refusing anything JSON would not give back unchanged (tuples, non-str keys, numpy
    scalars, tensors, ...): a resume must see exactly what was saved. The error names the offending entry."""

    def check(v, where: str) -> None:
        if v is None or isinstance(v, (bool, int, float, str)):
            return
        if isinstance(v, list):
            for i, x in enumerate(v):
                check(x, f"{where}[{i}]")
            return
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"{what}: key {k!r} of {where or 'the top level'} is a {type(k).__name__}; "
                        "only str keys survive JSON"
                    )
                check(x, f"{where}.{k}" if where else k)
            return
        raise TypeError(
            f"{what}: {where or 'the value'} is a {type(v).__module__}.{type(v).__name__}; "
            "a checkpoint stores only JSON types (None, bool, int, float, str, list, dict with str keys) here, "
            "so that loading it cannot run code"
        )

    check(value, "")
    return json.dumps(value)


class TrainerState(Stateful):
    """The trainer's progress: a snapshot dict (the same on every rank) to save, or ``restore`` to call on load.

    Stored as one JSON string (``to_json_text``: only JSON types, checked at save time), so the structure DCP sees
    does not depend on the trainer's components and loading it cannot run code; ``meta.json`` keeps a copy.
    """

    def __init__(self, snapshot: dict | None = None, restore: Callable[[dict], None] | None = None):
        self.snapshot, self.restore = snapshot, restore

    def state_dict(self) -> dict:
        if self.restore is not None:  # loading: DCP replaces this placeholder with the saved string
            return {"json": ""}
        return {"json": to_json_text(self.snapshot, what="trainer state")}

    def load_state_dict(self, state: dict) -> None:
        assert self.restore is not None, "TrainerState built for saving cannot load"
        self.restore(json.loads(state["json"]))


def encode_rng_state(state: dict) -> dict[str, torch.Tensor]:
    """``runtime.rng_state()`` as tensors only (``decode_rng_state`` inverts it exactly).

    python ``random``: (version, 625 words, gauss_next); numpy's legacy MT19937: ('MT19937', 624 words, pos,
    has_gauss, cached_gaussian); torch CPU and CUDA states are byte tensors already. Words are uint32 values, kept
    in int64; floats in float64 (exact for Python floats).
    """
    version, words, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    assert name == "MT19937", f"numpy's global generator is {name}, not MT19937"
    out = {
        "python.version": torch.tensor(version, dtype=torch.int64),
        "python.words": torch.tensor(words, dtype=torch.int64),
        "python.gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "numpy.pos_has_gauss": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy.cached_gaussian": torch.tensor(cached, dtype=torch.float64),
        "torch": state["torch"].clone(),
    }
    for i, s in enumerate(state.get("cuda", [])):
        out[f"cuda.{i}"] = s.clone()
    return out


def decode_rng_state(tensors: dict[str, torch.Tensor]) -> dict:
    has_gauss, gauss = tensors["python.gauss"].tolist()
    pos, numpy_has_gauss = tensors["numpy.pos_has_gauss"].tolist()
    state = {
        "python": (
            int(tensors["python.version"]),
            tuple(tensors["python.words"].tolist()),
            gauss if has_gauss else None,
        ),
        "numpy": (
            "MT19937",
            tensors["numpy.keys"].numpy().astype(np.uint32),
            pos,
            numpy_has_gauss,
            float(tensors["numpy.cached_gaussian"]),
        ),
        "torch": tensors["torch"],
    }
    cuda = sorted((int(k.split(".")[1]), v) for k, v in tensors.items() if k.startswith("cuda."))
    if cuda:
        state["cuda"] = [v for _, v in cuda]
    return state


class RNGState(Stateful):
    """This rank's global RNG states under ``rank_<r>.*`` (ranks write distinct keys; DCP keeps them all), as
    tensors (``encode_rng_state``)."""

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"
        self.only: set[str] | None = None  # on load: the parts this checkpoint holds (Checkpointer.load sets it)

    def state_dict(self) -> dict:
        parts = encode_rng_state(rng_state())
        if self.only is not None:
            parts = {k: v for k, v in parts.items() if k in self.only}
        return {self.key: parts}

    def load_state_dict(self, state: dict) -> None:
        saved = decode_rng_state(state[self.key])
        if self.only is not None and "cuda" not in saved:  # written without CUDA: keep this process's CUDA state
            saved.pop("cuda", None)
        set_rng_state(saved)


def encode_batch(batch: Batch) -> dict[str, torch.Tensor]:
    """A batch as tensors only (CPU): its tensor fields, and its objects as JSON text (``decode_batch`` inverts it)."""
    text = to_json_text(batch.objects, what="an in-flight batch's per-sample objects")
    return {
        **{k: v.cpu() for k, v in batch.tensors.items()},
        OBJECTS: torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).clone(),
    }


def decode_batch(state: dict[str, torch.Tensor]) -> Batch:
    objects = json.loads(bytes(state[OBJECTS].tolist()).decode())
    return Batch({k: v for k, v in state.items() if k != OBJECTS}, objects)


class InFlightBatches(Stateful):
    """Asynchronous RL's pipeline on one actor rank: the batches generated for the coming steps
    (``RolloutClient.queue``, ``trainer.max_staleness`` of them after every step), under
    ``rank_<dp rank>.batch_<i>.<field>``.

    Tensors of shapes known only from the checkpoint: before a load, ``expect`` is given the saved layout, and
    ``state_dict`` then returns empty tensors of those shapes for DCP to fill.
    """

    def __init__(self, queue: deque[Batch], *, rank: int, device: torch.device):
        self.queue, self.key, self.device = queue, f"rank_{rank}", device
        self.layout: dict[str, tuple[torch.Size, torch.dtype]] = {}  # this rank's saved tensors, while loading

    def state_dict(self) -> dict:
        if self.layout:
            nested: dict = {}
            for key, (shape, dtype) in self.layout.items():
                rank, batch, field = key.split(".")
                nested.setdefault(rank, {}).setdefault(batch, {})[field] = torch.empty(shape, dtype=dtype)
            return nested
        return {self.key: {f"batch_{i}": encode_batch(b) for i, b in enumerate(self.queue)}}

    def expect(self, saved: dict[str, tuple[torch.Size, torch.dtype]], *, path: Path, dp: int) -> None:
        """``saved``: every rank's in-flight tensors in checkpoint ``path`` (``CheckpointStore.saved_tensors``),
        written by how many actor ranks (``dp`` now) is checked: each rank's batches are its own prompts' samples."""
        ranks = {key.split(".")[0] for key in saved}
        if saved and ranks != {f"rank_{r}" for r in range(dp)}:
            raise CheckpointError(
                f"checkpoint {path} holds the in-flight batches of {len(ranks)} actor ranks (asynchronous RL, "
                f"trainer.max_staleness > 0), this run has {dp}: resume it on {len(ranks)} actor ranks, or with "
                "trainer.max_staleness=0 (those batches are then dropped)"
            )
        self.layout = {k: v for k, v in saved.items() if k.startswith(self.key + ".")}

    def load_state_dict(self, state: dict) -> None:
        batches = state[self.key]
        self.queue.clear()
        for i in range(len(batches)):
            self.queue.append(decode_batch(batches[f"batch_{i}"]).to(self.device))
        self.layout = {}
