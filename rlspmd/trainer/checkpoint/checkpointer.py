"""``Checkpointer``: the ``CheckpointStore`` of this package, torch.distributed.checkpoint (DCP) files under
``checkpoint.dir``.

Every rank writes its own shards in parallel and DCP reshards on load, so the world size may change between a save and
a resume. What it adds to DCP: the directory decisions (``layout.py``: atomic commit by rename, ``latest``, pruning,
which checkpoint to resume, rewinds), a SHA-256 digest of every file as it is written and a check of them before a
load (``integrity.py``), loading that runs no code (``safe_load.py``), and, before any shard is read, a check that the
checkpoint fits the run (format, roles, trainer components, every parameter's name and shape).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from rlspmd.config import CheckpointConfig
from rlspmd.distributed.dispatch import broadcast_object, on_main
from rlspmd.distributed.progress import progress
from rlspmd.trainer.checkpoint.base import CheckpointError
from rlspmd.trainer.checkpoint.integrity import (
    DIGEST,
    CheckpointDamagedError,
    DigestingFileSystemWriter,
    FileDigests,
    check_files,
    recorded_digests,
    share_files,
)
from rlspmd.trainer.checkpoint.layout import (
    CheckpointDir,
    check_format,
    config_problems,
    read_meta,
    step_dir_name,
)
from rlspmd.trainer.checkpoint.safe_load import dcp_load, read_dcp_metadata, saved_tensors
from rlspmd.trainer.checkpoint.state import PIPELINE, RNGState


class Checkpointer:
    """Saves and restores DCP checkpoints under ``cfg.dir``; every method is collective over ``mesh`` (the ranks
    that hold trainable state: the actor's; None = the whole world).

    Rank 0 makes the filesystem decisions (which checkpoint, create, rename, prune) and broadcasts them, so
    an error there is raised on every rank instead of leaving the others in a collective.
    """

    def __init__(self, cfg: CheckpointConfig, *, output_dir: str, rank: int, world_size: int, mesh=None):
        self.cfg = cfg
        self.mesh = mesh  # in split placement the rollout-only ranks hold no state and take no part
        self.root = Path(cfg.dir or Path(output_dir) / "checkpoints").expanduser()
        self.field = "checkpoint.dir" if cfg.dir else "checkpoint.dir (default <trainer.output_dir>/checkpoints)"
        self.dir = CheckpointDir(self.root, field=self.field)  # rank 0's decisions; the methods here broadcast them
        self.rank, self.world_size = rank, world_size
        self._verified: Path | None = None  # the checkpoint ``prepare`` picked and checked
        self.resume = cfg.resume.strip()
        # resuming a checkpoint named by path: any newer one belongs to an abandoned future (``supersede_after``)
        self.rewind = self.resume not in ("auto", "none")
        problems = config_problems(cfg)
        if problems:
            raise ValueError("; ".join(f"checkpoint.{name}={value!r}: {why}" for name, value, why in problems))

    # -- deciding ---------------------------------------------------------------------------------------

    def prepare(self) -> Path | None:
        """Check that the checkpoint root is writable and pick the checkpoint to resume from (None: fresh); collective.

        Runs before anything expensive, so a bad ``checkpoint.dir`` or ``checkpoint.resume`` fails in seconds. The pick
        is checked against the file digests its save recorded (``_verify``: every rank reads a share of the files and
        learns every rank's findings, so all take the same decision and none waits on another). A damaged checkpoint
        named by ``checkpoint.resume`` is an error naming the file; with ``auto`` the newest intact one is resumed
        instead, every rank says so, and the damaged ones are moved aside (``step_N.damaged-<time>``, kept) so that
        ``latest``, ``keep_last`` and the next save see this run's line of checkpoints only.
        """
        path = on_main(lambda: self.dir.choose(self.resume), mesh=self.mesh)
        damaged: list[CheckpointDamagedError] = []
        while path is not None:
            try:
                self._verify(path)
                break
            except CheckpointDamagedError as e:
                if self.resume != "auto":
                    raise
                damaged.append(e)
                path = on_main(lambda: self.dir.newest_before(e.path), mesh=self.mesh)
        if damaged and path is None:
            raise CheckpointError(
                f"checkpoint.resume=auto: every checkpoint in {self.field}={self.root} is damaged ("
                + "; ".join(str(e) for e in damaged)
                + "). Nothing was moved or removed: restore them, resume one with "
                "--resume PATH (which still checks it), or move them aside to start afresh"
            )
        aside = on_main(lambda: self.dir.settle(path, [e.path for e in damaged], rewind=self.rewind), mesh=self.mesh)
        for e in damaged:
            print(
                f"[rlspmd] rank {self.rank}: checkpoint.resume=auto: {e}; resuming from the newest intact checkpoint "
                f"{path.name} instead (moved {e.path.name} aside to {aside[e.path.name]})",
                flush=True,
            )
        self._verified = path
        return path

    def _prepare(self) -> Path | None:
        """``prepare`` in this one process, without the digest check: the bookkeeping its unit tests exercise."""
        path = self.dir.choose(self.resume)
        self.dir.settle(path, [], rewind=self.rewind)
        return path

    def _verify(self, path: Path) -> None:
        """Check checkpoint ``path``'s files against the digests ``meta.json`` records (collective over the mesh):
        the files are shared out by size, each rank hashes its share, and every rank gets every finding, so every
        rank raises the same ``CheckpointDamagedError`` (naming each file) or none does. A checkpoint written before
        digests were recorded is loaded unchecked, and rank 0 says so."""

        def record() -> dict[str, dict] | None:
            try:
                meta = read_meta(path)
            except CheckpointError as e:
                raise CheckpointDamagedError(path, [str(e)]) from None
            files = recorded_digests(path, meta)
            if files is None:
                print(
                    f"checkpoint {path} records no file digests (written before rlspmd recorded them): loading it "
                    "without checking its files",
                    flush=True,
                )
            return files

        files = on_main(record, mesh=self.mesh)
        if files is None:
            return
        group = self._group()
        n, me = dist.get_world_size(group), dist.get_rank(group)
        mine = share_files(files, n)[me]
        try:
            problems = check_files(path, {name: files[name] for name in mine})
        except Exception as e:  # noqa: BLE001 - reported like a damaged file: this rank must still join the gather
            problems = [f"rank {self.rank} could not check {mine}: {type(e).__name__}: {e}"]
        every: list[list[str] | None] = [None] * n
        dist.all_gather_object(every, problems, group=group)
        found = sorted(p for rank_problems in every for p in rank_problems)
        if found:
            raise CheckpointDamagedError(path, found)

    def due(self, step: int, *, last: bool) -> bool:
        every = self.cfg.save_every
        return bool(every and step % every == 0) or (last and self.cfg.save_final)

    # -- saving -----------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Stateful], *, meta: dict, write_files: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step``: DCP shards into ``step_N.tmp``, then ``write_files(tmp)`` (called on every
        rank; model config and tokenizer, the optional HF export), then ``meta.json``, rename, ``latest``, prune.

        Any failure removes the ``.tmp`` directory and raises ``CheckpointError`` on every rank. The save is a
        ``checkpoint`` stage of this rank's progress (the hang monitor names a rank stuck in it).
        """
        with progress.stage("checkpoint", step=step):
            return self._save(step, state, meta=meta, write_files=write_files)

    def _save(self, step: int, state: dict[str, Stateful], *, meta: dict, write_files: Callable[[Path], None]) -> Path:
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        previous = on_main(lambda: self.dir.start(tmp), mesh=self.mesh)
        try:
            written = FileDigests(tmp)
            dcp.save(state, storage_writer=DigestingFileSystemWriter(tmp, written), process_group=self._group())
            digests = self._gather_digests(written)
            write_files(tmp)
            meta = {
                **meta,
                "step": step,
                "world_size": self.world_size,
                "digests": {"algorithm": DIGEST, "files": digests},
            }
            on_main(lambda: self.dir.commit(tmp, final, meta), mesh=self.mesh)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank gets here (DCP and on_main raise
            # everywhere); DCP's CheckpointException is a BaseException
            reason = _first_failure(e)
            on_main(lambda: shutil.rmtree(tmp, ignore_errors=True), mesh=self.mesh)
            kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
            raise CheckpointError(
                f"{self.field}={self.root}: saving step {step} failed ({reason}); {kept} and `latest` is unchanged"
            ) from e
        on_main(lambda: self.dir.prune(keep=final, keep_last=self.cfg.keep_last), mesh=self.mesh)
        return final

    def _gather_digests(self, written: FileDigests) -> dict[str, dict]:
        """Every rank's written files, by name, on every rank (each rank writes its own shards, rank 0
        ``.metadata``)."""
        group = self._group()
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, written.files, group=group)
        merged: dict[str, dict] = {}
        for files in every:
            assert not set(files) & set(merged), f"two ranks wrote {sorted(set(files) & set(merged))}"
            merged.update(files)
        return dict(sorted(merged.items()))

    # -- restoring --------------------------------------------------------------------------------------

    def load(self, path: Path, state: dict[str, Stateful], *, engines: dict, components: list[str]) -> dict:
        """Restore ``state`` from checkpoint ``path``; returns its ``meta.json``.

        Before reading any shard it checks that the checkpoint fits this run: its format, the same roles, trainer
        components, and every engine's parameter names and shapes (a clear error names the first mismatch).
        Nothing read runs code (``safe_load.py``). A ``resume`` stage of this rank's progress.
        """
        with progress.stage("resume"):
            return self._load(path, state, engines=engines, components=components)

    def _load(self, path: Path, state: dict[str, Stateful], *, engines: dict, components: list[str]) -> dict:
        if path != self._verified:  # ``prepare`` checked the checkpoint it picked; any other is checked here
            self._verify(path)
        meta = on_main(lambda: self._check_fits(path, engines=engines, components=components), mesh=self.mesh)
        have_rng = broadcast_object(None if self.rank else self._rng_keys(path), mesh=self.mesh)
        state = dict(state)
        mine = f"rng.rank_{self.rank}."
        parts = {k[len(mine) :] for k in have_rng if k.startswith(mine)}
        if not parts:
            state.pop("rng", None)  # resuming on more ranks than wrote the checkpoint: these keep their seeds
        elif isinstance(state.get("rng"), RNGState):
            state["rng"].only = parts  # e.g. written without CUDA: restore the parts it has
        dcp_load(state, path, process_group=self._group())
        return meta

    def saved_tensors(self, path: Path, *, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of the tensors of ``path`` under ``prefix``, from its DCP metadata (no shard is read)."""
        return saved_tensors(path, prefix=prefix)

    def _group(self):
        return None if self.mesh is None else self.mesh.get_group()

    @staticmethod
    def _rng_keys(path: Path) -> set[str]:
        return {k for k in read_dcp_metadata(path).state_dict_metadata if k.startswith("rng.")}

    def _check_fits(self, path: Path, *, engines: dict, components: list[str]) -> dict:
        meta = read_meta(path)
        check_format(path, meta)
        saved = read_dcp_metadata(path).state_dict_metadata
        roles = sorted({k.split(".", 1)[0] for k in saved} - {"trainer", "rng", PIPELINE})
        for role, engine_shapes in engines.items():
            if role not in roles:
                raise CheckpointError(
                    f"checkpoint {path} has no {role!r} state (it holds {roles}); "
                    "it was written by a different kind of run"
                )
            self._check_shapes(path, role, engine_shapes, saved, meta)
        unused = sorted(set(roles) - set(engines))
        if unused:
            print(f"checkpoint {path} also holds {unused}, which this run does not train; not loaded", flush=True)
        missing = sorted(set(components) - set(meta.get("trainer_components", [])))
        if missing:
            raise CheckpointError(
                f"checkpoint {path} has no state for trainer component(s) {missing} "
                f"(it has {meta.get('trainer_components')}); it was written with a different algorithm config"
            )
        return meta

    @staticmethod
    def _check_shapes(path: Path, role: str, shapes: dict[str, torch.Size], saved: dict, meta: dict) -> None:
        source = meta.get("models", {}).get(role, "?")
        prefix = f"{role}.model."
        saved_model = {k[len(prefix) :]: v for k, v in saved.items() if k.startswith(prefix)}
        for name, shape in shapes.items():
            md = saved_model.get(name)
            if md is None:
                raise CheckpointError(
                    f"checkpoint {path} was written for a different model ({source}): "
                    f"it has no parameter {name!r} for {role}"
                )
            if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(shape):
                raise CheckpointError(
                    f"checkpoint {path} was written for a different model ({source}): {role} parameter {name!r} "
                    f"has shape {list(md.size)} in the checkpoint but {list(shape)} in this run's model"
                )
        extra = sorted(set(saved_model) - set(shapes))
        if extra:
            raise CheckpointError(
                f"checkpoint {path} was written for a different model ({source}): {role} parameter {extra[0]!r} "
                f"(and {len(extra) - 1} more) does not exist in this run's model"
            )


def _first_failure(e: BaseException) -> str:
    """The most telling failure behind a save error: an OSError (disk full, permissions) on any rank if there
    is one (DCP wraps per-rank failures; a torch.save error often hides the OSError in its context). torch.save's zip
    writer can also fail on a short write with no OSError at all; that case is said in words."""
    failures = sorted(e.failures.items()) if isinstance(e, CheckpointException) and e.failures else [(None, (e, None))]
    candidates = []
    for rank, (exc, _trace) in failures:
        chain = exc
        while chain is not None:
            candidates.append((rank, chain))
            chain = chain.__cause__ or chain.__context__
    rank, exc = next(((r, x) for r, x in candidates if isinstance(x, OSError)), candidates[0])
    text = f"{type(exc).__name__}: {exc}"
    if "inline_container" in text and "unexpected pos" in text:
        text += " (a write came up short: is the disk or quota full, or a file-size limit reached?)"
    return f"rank {rank}: {text}" if rank is not None else text
