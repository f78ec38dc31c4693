"""The checkpoint root on disk: directory names, which checkpoints are complete, the one a resume picks, the commit
by rename, the ``latest`` pointer, pruning. Plain files and renames, decided on one rank (the ``Checkpointer``
broadcasts the outcome); no torch.

Layout of ``checkpoint.dir``:

    step_00000010/        a complete checkpoint; the rename from ``.tmp`` is the commit point
        .metadata, *.distcp   DCP shards
        meta.json             step, world size, roles, model sources, trainer state (readable), run config, and
                              the size and SHA-256 of every DCP file (``digests``)
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
import re
import shutil
import time
from pathlib import Path

from rlspmd.components import Problem
from rlspmd.config import CheckpointConfig
from rlspmd.trainer.checkpoint.base import CheckpointError

STEP_RE = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 2


def config_problems(cfg: CheckpointConfig) -> list[Problem]:
    """The checks of the ``checkpoint`` section's numbers, as ``(field, value, why)`` (fields relative to the section):
    the one place they are written. ``rlspmd.validate`` reports them with every other problem before anything loads;
    the ``Checkpointer`` refuses a section that has any (it may be built without the collector, in a tool or test)."""
    return [
        (name, v, "must be >= 0") for name, v in (("save_every", cfg.save_every), ("keep_last", cfg.keep_last)) if v < 0
    ]


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


def check_format(path: Path, meta: dict) -> None:
    """Only this format is resumed: format 1 stored trainer and RNG state as pickles, which run code when loaded."""
    found = meta.get("format")
    if found == FORMAT_VERSION:
        return
    if found == 1:
        raise CheckpointError(
            f"checkpoint {path} is format 1, which stores the trainer and RNG state as Python pickles: loading it "
            f"could run code, so this version (format {FORMAT_VERSION}) does not resume it. To keep its weights, "
            f"export them (python scripts/export_hf.py {path} OUT, which reads tensors only) and start a new run from "
            "OUT; to continue the run exactly, resume it with the rlspmd version that wrote it, if you trust where it "
            "came from"
        )
    raise CheckpointError(
        f"checkpoint {path}: meta.json has format {found!r}; this version reads format {FORMAT_VERSION}"
    )


def fsync_dir(path: Path) -> None:
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


class CheckpointDir:
    """The decisions about the directories under ``root`` (one process: rank 0). ``field`` names the setting
    that chose ``root``, for error messages."""

    def __init__(self, root: Path, *, field: str):
        self.root, self.field = root, field

    def check_writable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write_probe_{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise PermissionError(
                f"{self.field}={self.root} is not a writable directory: {type(e).__name__}: {e}"
            ) from None

    def choose(self, resume: str) -> Path | None:
        """Which checkpoint ``checkpoint.resume`` (``resume``, stripped) asks for; nothing on disk changes yet."""
        self.check_writable()
        if resume == "none":
            existing = complete_checkpoints(self.root)
            if existing:
                raise ValueError(
                    f"checkpoint.resume=none, but {self.field}={self.root} already holds checkpoints (newest "
                    f"{existing[-1].name}) from an earlier run: continue it with --resume auto, or give this run "
                    "a new trainer.output_dir or checkpoint.dir"
                )
            return None
        if resume == "auto":
            found = complete_checkpoints(self.root)
            return found[-1] if found else None
        return resolve_checkpoint(resume, field_name="checkpoint.resume")

    def newest_before(self, path: Path) -> Path | None:
        older = [p for p in complete_checkpoints(self.root) if p.name < path.name]
        return older[-1] if older else None

    def settle(self, path: Path | None, damaged: list[Path], *, rewind: bool) -> dict[str, str]:
        """Once the checkpoint to resume is known to be intact: move the damaged ones aside (returns their new names),
        and, when resuming an explicit older checkpoint (``rewind``), the newer ones (``supersede_after``)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = {}
        for p in damaged:
            aside[p.name] = f"{p.name}.damaged-{stamp}"
            p.rename(p.with_name(aside[p.name]))
        if damaged:
            self.write_latest()
        if path is not None and rewind:
            self.supersede_after(int(STEP_RE.match(path.name).group(1)))
        return aside

    def supersede_after(self, step: int) -> None:
        """Resuming from an older checkpoint (rewinding a run): newer checkpoints in ``dir`` belong to the abandoned
        future. Rename them out of the way (kept, but never resumed from or pruned) so ``auto`` and ``keep_last``
        only see this run's line of checkpoints."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        newer = [p for p in complete_checkpoints(self.root) if int(STEP_RE.match(p.name).group(1)) > step]
        for p in newer:
            p.rename(p.with_name(f"{p.name}.superseded-{stamp}"))
            print(
                f"checkpoint.resume: resuming from step {step}; moved the newer {p.name} aside to "
                f"{p.name}.superseded-{stamp}",
                flush=True,
            )
        if newer:
            self.write_latest()

    def write_latest(self) -> None:
        """Point ``latest`` at the newest complete checkpoint (atomically), or remove it when there is none."""
        found = complete_checkpoints(self.root)
        if not found:
            (self.root / "latest").unlink(missing_ok=True)
            return
        pointer = self.root / "latest.tmp"
        pointer.write_text(found[-1].name + "\n")
        os.replace(pointer, self.root / "latest")
        fsync_dir(self.root)

    def start(self, tmp: Path) -> str | None:
        """Make a fresh ``tmp`` directory for a save; returns the name of the newest complete checkpoint (kept intact
        whatever happens to this save)."""
        self.check_writable()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        found = complete_checkpoints(self.root)
        return found[-1].name if found else None

    def commit(self, tmp: Path, final: Path, meta: dict) -> None:
        """Write ``meta.json`` last, rename ``tmp`` to ``final`` (the commit point), then point ``latest`` at it."""
        meta = {"format": FORMAT_VERSION, "time": time.time(), **meta}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        fsync_dir(tmp)
        if final.exists():  # an older run's checkpoint of the same step: replace it without a gap
            old = final.with_name(final.name + f".replaced-{int(time.time())}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        self.write_latest()

    def prune(self, keep: Path, *, keep_last: int) -> None:
        """Remove interrupted saves, and all but the newest ``keep_last`` checkpoints (0 keeps all) except ``keep``."""
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if keep_last:
            for old in complete_checkpoints(self.root)[:-keep_last]:
                if old != keep:
                    shutil.rmtree(old, ignore_errors=True)
