"""What a checkpoint holds, written down: one explicit dict of named ``Stateful`` objects (torchtitan's way), so
renaming an attribute can never silently change what is saved.

    actor, critic       the trained roles' engines (``TrainingEngine.state_dict``: sharded model and optimiser state,
                        LR schedule; DCP reshards on load, so the world size may change)
    trainer             the step, counters, and the state of every trainer component named by the builder
                        (``sampler``: the data order on rank 0; ``token_rewards``: the adaptive KL controller)
    rng                 every rank's global RNG states

``Checkpointing`` pairs that dict with the ``Checkpointer`` (where and how: DCP, atomic commit, pruning, resume
choice) and the run's metadata. The rollout-only ranks of a split placement hold no state (``NoCheckpointing``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.distributed.dispatch import broadcast_object
from rlspmd.engines.base import TrainingEngine
from rlspmd.trainer.checkpoint import Checkpointer, RNGState, TrainerState


@dataclasses.dataclass
class Counters:
    """The trainer's own progress (the same on every rank)."""

    step: int = 0
    skipped_updates_total: float = 0.0


class Checkpointing:
    def __init__(self, checkpointer: Checkpointer, *, engines: dict[str, TrainingEngine], components: dict[str, Stateful],
                 mesh: DeviceMesh, rank: int, is_main: bool, meta: dict, write_files: Callable[[Path], None]):
        """``engines``: the trained roles' engines by checkpoint key; ``components``: the trainer components whose
        state is saved (on rank 0 they include the data sampler, which only rank 0 holds); ``meta``: what
        ``meta.json`` records about the run; ``write_files(dir)``: model config, tokenizer, HF export (collective)."""
        self.checkpointer, self.engines, self.components = checkpointer, engines, components
        self.mesh, self.rank, self.is_main, self.meta, self.write_files = mesh, rank, is_main, meta, write_files

    def due(self, step: int, *, last: bool) -> bool:
        return self.checkpointer.due(step, last=last)

    def state(self, trainer: TrainerState) -> dict[str, Stateful]:
        """The explicit checkpoint state: the engines, the trainer's state, this rank's RNGs."""
        return {**self.engines, "trainer": trainer, "rng": RNGState(self.rank)}

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
        meta = {**self.meta, "roles": sorted(self.engines), "trainer_components": sorted(snapshot["components"]),
                "trainer_state": snapshot}
        return self.checkpointer.save(counters.step, self.state(TrainerState(snapshot)), meta=meta, write_files=self.write_files)

    def restore(self, path: Path) -> Counters:
        """Load ``path`` into the engines and components; returns the trainer's counters."""
        restored = {}

        def put(snapshot: dict) -> None:
            restored["counters"] = Counters(step=int(snapshot["step"]), skipped_updates_total=float(snapshot["skipped_updates_total"]))
            for name, component in self.components.items():
                component.load_state_dict(snapshot["components"][name])

        meta = self.checkpointer.load(
            path, self.state(TrainerState(restore=put)), engines={name: e.param_shapes() for name, e in self.engines.items()},
            components=sorted(self.components),
        )
        if meta["world_size"] != self.mesh.size() and self.is_main:
            print(f"checkpoint {path} was written by {meta['world_size']} ranks; resharded onto {self.mesh.size()}", flush=True)
        return restored["counters"]


class NoCheckpointing:
    """Rollout-only ranks of a split placement: they hold no state; every checkpoint call is the actor side's."""

    def due(self, step: int, *, last: bool) -> bool:
        return False

    def save(self, counters: Counters) -> None:
        return None
