"""Checkpoints: torch.distributed.checkpoint (DCP) over a dict of ``Stateful`` objects, and Hugging Face export.

What a checkpoint holds (``Checkpointer.save``), one key per object:

    actor, critic, ...   every trainable role engine: sharded model and optimiser state, LR schedule
                         (``FSDPEngine.state_dict``; DCP reshards on load, so the world size may change)
    trainer              the step, counters, and the ``state_dict()`` of every trainer component that has one
                         (data sampler position, KL controller, ...), as one pickled value
    rng                  every rank's python/numpy/torch/CUDA RNG state (``rank_<r>``); the rollout sampler
                         derives its generator from (seed, step, rank), so the step covers it

Layout of ``checkpoint.dir``:

    step_00000010/        a complete checkpoint; the rename from ``.tmp`` is the commit point
        .metadata, *.distcp   DCP shards
        meta.json             step, world size, roles, model sources, trainer state (readable), run config
        model/                config.json, generation_config.json, tokenizer: all ``scripts/export_hf.py`` needs
        hf/                   the actor as a Hugging Face directory (``checkpoint.save_hf``)
    step_00000020.tmp/    a save in progress, or an interrupted one: never resumed from, removed by the next save
    latest                the newest complete checkpoint's name, replaced atomically after the rename

Resume picks the newest complete ``step_*`` directory (``latest`` names the same one except in the instant
between a rename and the pointer update). A failed save (disk full, permissions) removes its ``.tmp``
directory and raises on every rank; the previous checkpoint and ``latest`` are untouched.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from rlspmd.config import CheckpointConfig
from rlspmd.distributed.dispatch import broadcast_object, on_main
from rlspmd.distributed.runtime import rng_state, set_rng_state

STEP_RE = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return STEP_RE.match(path.name) is not None and (path / "meta.json").is_file() and (path / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and is_complete(p)), key=lambda p: p.name)


def resolve_checkpoint(path: str | Path, *, field_name: str) -> Path:
    """A checkpoint directory, or a checkpoint root (-> its newest complete checkpoint); errors name the path."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{field_name}: checkpoint {p} does not exist")
    if is_complete(p):
        return p
    if p.name.endswith(".tmp"):
        raise ValueError(f"{field_name}: {p} is an interrupted save (a .tmp directory), not a checkpoint")
    found = complete_checkpoints(p)
    if found:
        return found[-1]
    if STEP_RE.match(p.name):
        raise ValueError(f"{field_name}: {p} is incomplete (no meta.json or DCP .metadata)")
    raise ValueError(f"{field_name}: {p} holds no complete checkpoint (step_XXXXXXXX directories)")


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read meta.json: {e}") from None


class TrainerState(Stateful):
    """The trainer's progress: a snapshot dict (the same on every rank) to save, or ``restore`` to call on load.

    Stored as one pickled leaf so that DCP sees the same structure whatever components the trainer has;
    ``meta.json`` keeps a readable copy.
    """

    def __init__(self, snapshot: dict | None = None, restore: Callable[[dict], None] | None = None):
        self.snapshot, self.restore = snapshot, restore

    def state_dict(self) -> dict:
        return {"pickle": pickle.dumps(self.snapshot)}

    def load_state_dict(self, state: dict) -> None:
        assert self.restore is not None, "TrainerState built for saving cannot load"
        self.restore(pickle.loads(state["pickle"]))


class RNGState(Stateful):
    """This rank's global RNG states under ``rank_<r>`` (ranks write distinct keys; DCP keeps them all)."""

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict:
        return {self.key: pickle.dumps(rng_state())}

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(pickle.loads(state[self.key]))


def _first_failure(e: BaseException) -> str:
    """The most telling failure behind a save error: an OSError (disk full, permissions) on any rank if there
    is one (DCP wraps per-rank failures; a torch.save error often hides the OSError in its context)."""
    failures = sorted(e.failures.items()) if isinstance(e, CheckpointException) and e.failures else [(None, (e, None))]
    candidates = []
    for rank, (exc, _trace) in failures:
        chain = exc
        while chain is not None:
            candidates.append((rank, chain))
            chain = chain.__cause__ or chain.__context__
    rank, exc = next(((r, x) for r, x in candidates if isinstance(x, OSError)), candidates[0])
    where = f"rank {rank}: " if rank is not None else ""
    return f"{where}{type(exc).__name__}: {exc}"


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
        self.rank, self.world_size = rank, world_size
        if cfg.save_every < 0 or cfg.keep_last < 0:
            raise ValueError(f"checkpoint.save_every={cfg.save_every} and checkpoint.keep_last={cfg.keep_last} must be >= 0")

    # -- deciding ---------------------------------------------------------------------------------------

    def prepare(self) -> Path | None:
        """Check that the checkpoint root is writable and pick the checkpoint to resume from (None: fresh).

        Runs before anything expensive, so a bad ``checkpoint.dir`` or ``checkpoint.resume`` fails in seconds.
        """
        return on_main(self._prepare, mesh=self.mesh)

    def _prepare(self) -> Path | None:
        self._check_writable()
        spec = self.cfg.resume.strip()
        if spec == "none":
            existing = complete_checkpoints(self.root)
            if existing:
                raise ValueError(
                    f"checkpoint.resume=none, but {self.field}={self.root} already holds checkpoints (newest "
                    f"{existing[-1].name}) from an earlier run: continue it with --resume auto, or give this run "
                    "a new trainer.output_dir or checkpoint.dir"
                )
            return None
        if spec == "auto":
            found = complete_checkpoints(self.root)
            return found[-1] if found else None
        path = resolve_checkpoint(spec, field_name="checkpoint.resume")
        self._supersede_after(int(STEP_RE.match(path.name).group(1)))
        return path

    def _supersede_after(self, step: int) -> None:
        """Resuming from an older checkpoint (rewinding a run): newer checkpoints in ``dir`` belong to the abandoned
        future. Rename them out of the way (kept, but never resumed from or pruned) so ``auto`` and ``keep_last``
        only see this run's line of checkpoints."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        newer = [p for p in complete_checkpoints(self.root) if int(STEP_RE.match(p.name).group(1)) > step]
        for p in newer:
            p.rename(p.with_name(f"{p.name}.superseded-{stamp}"))
            print(f"checkpoint.resume: resuming from step {step}; moved the newer {p.name} aside to {p.name}.superseded-{stamp}", flush=True)
        if newer:
            self._write_latest()

    def _write_latest(self) -> None:
        """Point ``latest`` at the newest complete checkpoint (atomically), or remove it when there is none."""
        found = complete_checkpoints(self.root)
        if not found:
            (self.root / "latest").unlink(missing_ok=True)
            return
        pointer = self.root / "latest.tmp"
        pointer.write_text(found[-1].name + "\n")
        os.replace(pointer, self.root / "latest")
        _fsync_dir(self.root)

    def _check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write_probe_{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise PermissionError(f"{self.field}={self.root} is not a writable directory: {type(e).__name__}: {e}") from None

    def due(self, step: int, *, last: bool) -> bool:
        every = self.cfg.save_every
        return bool(every and step % every == 0) or (last and self.cfg.save_final)

    # -- saving -----------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Stateful], *, meta: dict, write_files: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step``: DCP shards into ``step_N.tmp``, then ``write_files(tmp)`` (called on every
        rank; model config and tokenizer, the optional HF export), then ``meta.json``, rename, ``latest``, prune.

        Any failure removes the ``.tmp`` directory and raises ``CheckpointError`` on every rank.
        """
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        previous = on_main(lambda: self._start(tmp), mesh=self.mesh)
        try:
            dcp.save(state, checkpoint_id=str(tmp), process_group=self._group())
            write_files(tmp)
            on_main(lambda: self._commit(tmp, final, {**meta, "step": step, "world_size": self.world_size}), mesh=self.mesh)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank gets here (DCP and on_main raise
            # everywhere); DCP's CheckpointException is a BaseException
            reason = _first_failure(e)
            on_main(lambda: shutil.rmtree(tmp, ignore_errors=True), mesh=self.mesh)
            kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
            raise CheckpointError(
                f"{self.field}={self.root}: saving step {step} failed ({reason}); {kept} and `latest` is unchanged"
            ) from e
        on_main(lambda: self._prune(keep=final), mesh=self.mesh)
        return final

    def _start(self, tmp: Path) -> str | None:
        self._check_writable()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        found = complete_checkpoints(self.root)
        return found[-1].name if found else None

    def _commit(self, tmp: Path, final: Path, meta: dict) -> None:
        meta = {"format": FORMAT_VERSION, "time": time.time(), **meta}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        _fsync_dir(tmp)
        if final.exists():  # an older run's checkpoint of the same step: replace it without a gap
            old = final.with_name(final.name + f".replaced-{int(time.time())}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        self._write_latest()

    def _prune(self, keep: Path) -> None:
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.cfg.keep_last:
            for old in complete_checkpoints(self.root)[: -self.cfg.keep_last]:
                if old != keep:
                    shutil.rmtree(old, ignore_errors=True)

    # -- restoring --------------------------------------------------------------------------------------

    def load(self, path: Path, state: dict[str, Stateful], *, engines: dict, components: list[str]) -> dict:
        """Restore ``state`` from checkpoint ``path``; returns its ``meta.json``.

        Before reading any shard it checks that the checkpoint fits this run: the same roles, trainer
        components, and every engine's parameter names and shapes (a clear error names the first mismatch).
        """
        meta = on_main(lambda: self._check_fits(path, engines=engines, components=components), mesh=self.mesh)
        have_rng = broadcast_object(None if self.rank else self._rng_keys(path), mesh=self.mesh)
        state = dict(state)
        if f"rng.rank_{self.rank}" not in have_rng:
            state.pop("rng", None)  # resuming on more ranks than wrote the checkpoint: these keep their seeds
        dcp.load(state, checkpoint_id=str(path), process_group=self._group())
        return meta

    def _group(self):
        return None if self.mesh is None else self.mesh.get_group()

    @staticmethod
    def _rng_keys(path: Path) -> set[str]:
        md = FileSystemReader(str(path)).read_metadata()
        return {k for k in md.state_dict_metadata if k.startswith("rng.")}

    def _check_fits(self, path: Path, *, engines: dict, components: list[str]) -> dict:
        meta = read_meta(path)
        try:
            saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - name the file
            raise CheckpointError(f"checkpoint {path}: cannot read the DCP metadata (.metadata): {e}") from None
        roles = sorted({k.split(".", 1)[0] for k in saved} - {"trainer", "rng"})
        for role, engine_shapes in engines.items():
            if role not in roles:
                raise CheckpointError(f"checkpoint {path} has no {role!r} state (it holds {roles}); it was written by a different kind of run")
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
        saved_model = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        for name, shape in shapes.items():
            md = saved_model.get(name)
            if md is None:
                raise CheckpointError(
                    f"checkpoint {path} was written for a different model ({source}): it has no parameter {name!r} for {role}"
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


def _fsync_dir(path: Path) -> None:
    """Make a rename/creation durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- Hugging Face directories -------------------------------------------------------------------------------


def write_hf_dir(hf_model, state_dict: dict[str, torch.Tensor], tokenizer, source_dir: str | Path, out: str | Path,
                 *, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json``, safetensors, the tokenizer and the generation config into ``out`` (one process).

    Written into ``out.tmp`` and renamed, so an interrupted write never leaves a half-written model.
    """
    out = Path(out)
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    gen = Path(source_dir) / "generation_config.json"
    if gen.is_file():
        shutil.copy(gen, tmp / "generation_config.json")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
)


def copy_model_files(model_dir: str | Path, tokenizer_dir: str | Path, out: Path) -> None:
    """Copy the model's config, generation config and tokenizer files verbatim: with the weights in the DCP
    shards, that is all it takes to turn a checkpoint back into an HF model (``scripts/export_hf.py``)."""
    out.mkdir(parents=True, exist_ok=True)
    for src, names in ((Path(model_dir), MODEL_FILES), (Path(tokenizer_dir), TOKENIZER_FILES)):
        for name in names:
            if (src / name).is_file():
                shutil.copy(src / name, out / name)


def save_hf_model(engine, tokenizer, source_dir: str | Path, out: str | Path, *, is_main: bool, dtype: torch.dtype | None = None) -> Path:
    """Gather the engine's full weights (collective) and write them as an HF directory on rank 0."""
    sd = engine.hf_state_dict()
    if is_main:
        write_hf_dir(engine.hf_model, sd, tokenizer, source_dir, out, dtype=dtype)
    return Path(out)
