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

``Checkpointing`` pairs that dict with a ``CheckpointStore`` (where and how; ``Checkpointer``: DCP, atomic commit,
pruning, resume choice) and the run's metadata. The rollout-only ranks of a split placement hold no state
(``NoCheckpointing``): even pipelined, they hand every batch back within the step that generated it.

``StopAndSave`` is the end of every step, for RL (``RLTrainer.fit``) and SFT alike: save when the schedule says so,
and on a stop (a signal on any rank, or the stop step) save and end the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.distributed.dispatch import broadcast_object, on_main
from rlspmd.distributed.runtime import StopRequest
from rlspmd.engines.base import TrainingEngine
from rlspmd.metrics import MetricLogger
from rlspmd.trainer.checkpoint.base import CheckpointStore
from rlspmd.trainer.checkpoint.state import PIPELINE, InFlightBatches, RNGState, TrainerState


@dataclasses.dataclass
class Counters:
    """The trainer's own progress (the same on every rank)."""

    step: int = 0
    skipped_updates_total: float = 0.0


class Checkpointing:
    def __init__(
        self,
        checkpointer: CheckpointStore,
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
            saved = on_main(lambda: self.checkpointer.saved_tensors(path, prefix=PIPELINE + "."), mesh=self.mesh)
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


class StopAndSave:
    """The end of a step, the same for RL and SFT: save when ``checkpoint.save_every`` or ``save_final`` says so, and
    on a stop (SIGTERM/SIGUSR1 on any rank, or the stop step) save, say how to continue, and end the run.

    Collective: every rank calls it after every step (the signal check is an all-reduce; the save is collective over
    the ranks that hold state). A stop at the last step is simply the end of the run (saved all the same, and SFT still
    writes its export). ``stop_field`` names the stop step's setting in messages (``trainer.stop_at_step``,
    ``stop_at_step``).
    """

    def __init__(
        self,
        checkpointing: Checkpointing | NoCheckpointing,
        stop_request: StopRequest,
        *,
        device: torch.device,
        logger: MetricLogger,
        total_steps: int,
        stop_at_step: int,
        stop_field: str,
        last: Path | None = None,
    ):
        self.checkpointing, self.stop_request, self.device, self.logger = checkpointing, stop_request, device, logger
        self.total_steps, self.stop_at_step, self.stop_field = total_steps, stop_at_step, stop_field
        self.last = last
        """The run's newest checkpoint (the one it resumed from until it saves one), for messages."""

    def __call__(self, counters: Counters) -> bool:
        """After step ``counters.step``: save if due or stopping; True when the run must stop now."""
        step = counters.step
        last_step = step == self.total_steps
        signalled = self.stop_request.agreed(self.device)
        stop = signalled or step == self.stop_at_step
        if stop or self.checkpointing.due(step, last=last_step):
            path = self.checkpointing.save(counters)
            if path is not None:  # None: a rollout-only rank, which saves nothing
                self.last = path
                self.logger.write(f"step {step}: saved checkpoint {path}")
        if not stop or last_step:
            return False
        why = "a stop signal (SIGTERM/SIGUSR1)" if signalled else f"{self.stop_field}={self.stop_at_step}"
        self.logger.write(f"stopped after step {step} on {why}; checkpoint {self.last}; continue with --resume auto")
        return True
