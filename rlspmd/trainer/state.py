"""What a checkpoint holds, written down: one explicit dict of named ``Stateful`` objects (torchtitan's way), so
renaming an attribute can never silently change what is saved.

    actor, critic       the trained roles' engines (``TrainingEngine.state_dict``: sharded model and optimiser state,
                        LR schedule; DCP reshards on load, so the world size may change)
    trainer             the step, counters, and the state of every trainer component named by the builder
                        (``sampler``: the data order on rank 0; ``token_rewards``: the adaptive KL controller)
    rng                 every rank's global RNG states
    pipeline            asynchronous RL (``trainer.max_staleness`` > 0): the batches each actor rank holds for the
                        coming steps, generated with older weights (``InFlightBatches``); saved, not regenerated, since
                        those weights are gone

``Checkpointing`` pairs that dict with the ``Checkpointer`` (where and how: DCP, atomic commit, pruning, resume
choice) and the run's metadata. The rollout-only ranks of a split placement hold no state (``NoCheckpointing``): even
pipelined, they hand every batch back within the step that generated it.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.distributed.dispatch import broadcast_object, on_main
from rlspmd.engines.base import TrainingEngine
from rlspmd.protocol import Batch
from rlspmd.trainer.checkpoint import (
    PIPELINE,
    CheckpointError,
    Checkpointer,
    RNGState,
    TrainerState,
    copy_model_files,
    saved_tensors,
    to_json_text,
    write_hf_dir,
)

OBJECTS = "objects_json"
"""A batch's per-sample objects in a checkpoint: their JSON text as a uint8 tensor (loading it runs no code)."""


@dataclasses.dataclass
class Counters:
    """The trainer's own progress (the same on every rank)."""

    step: int = 0
    skipped_updates_total: float = 0.0


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
    """Asynchronous RL's pipeline on one actor rank: the batches generated for the coming steps (``RolloutClient.queue``,
    ``trainer.max_staleness`` of them after every step), under ``rank_<dp rank>.batch_<i>.<field>``.

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
        """``saved``: every rank's in-flight tensors in checkpoint ``path`` (``saved_tensors``), written by how many
        actor ranks (``dp`` now) is checked: each rank's batches are its own prompts' samples."""
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


def write_model_files(
    ckpt: Path,
    *,
    model_path: str,
    tokenizer_path: str | None,
    save_hf: bool,
    tokenizer,
    engine: TrainingEngine,
    mesh: DeviceMesh,
) -> None:
    """A checkpoint's ``write_files`` (RL and SFT): the model's config and tokenizer files for export, and with
    ``checkpoint.save_hf`` the actor as an HF directory (collective: every rank gathers the full weights)."""
    full = engine.hf_state_dict() if save_hf else None

    def write():
        copy_model_files(model_path, tokenizer_path or model_path, ckpt / "model")
        if full is not None:
            write_hf_dir(engine.hf_model, full, tokenizer, model_path, ckpt / "hf")

    on_main(write, mesh=mesh)


class Checkpointing:
    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        engines: dict[str, TrainingEngine],
        components: dict[str, Stateful],
        mesh: DeviceMesh,
        rank: int,
        is_main: bool,
        meta: dict,
        write_files: Callable[[Path], None],
        pipeline: InFlightBatches | None = None,
    ):
        """``engines``: the trained roles' engines by checkpoint key; ``components``: the trainer components whose
        state is saved (on rank 0 they include the data sampler, which only rank 0 holds); ``meta``: what
        ``meta.json`` records about the run; ``write_files(dir)``: model config, tokenizer, HF export (collective);
        ``pipeline``: asynchronous RL's batches in flight."""
        self.checkpointer, self.engines, self.components = checkpointer, engines, components
        self.mesh, self.rank, self.is_main, self.meta, self.write_files = mesh, rank, is_main, meta, write_files
        self.pipeline = pipeline

    def due(self, step: int, *, last: bool) -> bool:
        return self.checkpointer.due(step, last=last)

    def state(self, trainer: TrainerState) -> dict[str, Stateful]:
        """The explicit checkpoint state: the engines, the trainer's state, this rank's RNGs, the batches in flight."""
        pipeline = {PIPELINE: self.pipeline} if self.pipeline is not None else {}
        return {**self.engines, "trainer": trainer, "rng": RNGState(self.rank), **pipeline}

    def save(self, counters: Counters) -> Path:
        snapshot = broadcast_object(  # rank 0 owns the sampler: its view is the record, the same on every rank
            {
                **dataclasses.asdict(counters),
                "components": {name: c.state_dict() for name, c in self.components.items()},
            }
            if self.is_main
            else None,
            mesh=self.mesh,
        )
        meta = {
            **self.meta,
            "roles": sorted(self.engines),
            "trainer_components": sorted(snapshot["components"]),
            "trainer_state": snapshot,
        }
        return self.checkpointer.save(
            counters.step, self.state(TrainerState(snapshot)), meta=meta, write_files=self.write_files
        )

    def restore(self, path: Path) -> Counters:
        """Load ``path`` into the engines and components; returns the trainer's counters."""
        restored = {}

        def put(snapshot: dict) -> None:
            restored["counters"] = Counters(
                step=int(snapshot["step"]), skipped_updates_total=float(snapshot["skipped_updates_total"])
            )
            for name, component in self.components.items():
                component.load_state_dict(snapshot["components"][name])

        state = self.state(TrainerState(restore=put))
        if self.pipeline is not None:
            saved = on_main(lambda: saved_tensors(path, prefix=PIPELINE + "."), mesh=self.mesh)
            self.pipeline.expect(saved, path=path, dp=self.mesh.size())
            if not self.pipeline.layout:  # a synchronous run's checkpoint: the pipeline fills at the next step
                state.pop(PIPELINE)
        meta = self.checkpointer.load(
            path,
            state,
            engines={name: e.param_shapes() for name, e in self.engines.items()},
            components=sorted(self.components),
        )
        if meta["world_size"] != self.mesh.size() and self.is_main:
            print(
                f"checkpoint {path} was written by {meta['world_size']} ranks; resharded onto {self.mesh.size()}",
                flush=True,
            )
        return restored["counters"]


class NoCheckpointing:
    """Rollout-only ranks of a split placement: they hold no state; every checkpoint call is the actor side's."""

    def due(self, step: int, *, last: bool) -> bool:
        return False

    def save(self, counters: Counters) -> None:
        return None
