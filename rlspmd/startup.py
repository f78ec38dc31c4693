"""The start-up every entry point shares (``rlspmd.train``, ``rlspmd.sft``): the config file and command-line
overrides, the process groups, seeding, the role meshes and the printed layout; ``--dry-run`` ends there.

``--config FILE[:NAME]``, ``--dry-run`` and ``--resume`` are read first; a component named by its import path
(``actor.policy-loss:path/to/my_losses.py:MyLoss``, ``algorithm.adv-estimator:my_pkg.estimators:MyEstimator``) is
imported next, so that it registers itself and tyro offers it like a built-in one; tyro then applies the remaining
``--section.field`` overrides to the loaded config.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import operator
import os
import sys
import time

import tyro

from rlspmd.components import picked_fields, picked_paths
from rlspmd.config import Config, DistConfig, MeshConfig, load_config_file
from rlspmd.distributed.mesh import ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import (
    Runtime,
    UserError,
    init_distributed,
    quiet_libraries,
    seed_everything,
    set_deterministic,
    shutdown,
)


USAGE_ERROR_GRACE_S = 10.0
"""How long a rank other than 0 waits, after a command-line usage error, for rank 0 to report it."""


def parse_args(argv: list[str] | None, config_type: type = Config, prog: str = "rlspmd.train"):
    """``(config, dry_run)`` from ``--config FILE``, ``--dry-run``, ``--resume`` and tyro's
    ``--section.field`` overrides."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--dry-run", action="store_true")
    has_checkpoint = "checkpoint" in {f.name for f in dataclasses.fields(config_type)}
    if has_checkpoint:
        pre.add_argument("--resume", default=None)
    known, rest = pre.parse_known_args(argv)
    if has_checkpoint and known.resume is not None:
        rest = [*rest, "--checkpoint.resume", known.resume]
    default = load_config_file(known.config, config_type) if known.config else config_type()
    rest = name_negated_components(import_components(rest, config_type), default)
    description = (
        f"{prog}: --config FILE[:NAME] (a Python file defining `config`, or the object NAME), --dry-run, "
        + ("--resume auto|none|PATH, " if has_checkpoint else "")
        + "then overrides of any field below."
    )
    quiet = os.environ.get("RANK", "0") != "0"  # every rank parses the same argv; let rank 0 report problems
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull if quiet else sys.stderr):
            # CascadeSubcommandArgs: a component picked by name (``actor.policy-loss:gspo``) may stand anywhere on the
            # line, and options of every level may follow it
            cfg = tyro.cli(
                config_type,
                default=default,
                args=rest,
                description=description,
                prog=prog,
                config=(tyro.conf.CascadeSubcommandArgs,),
            )
    except SystemExit as e:
        if quiet and e.code:
            # A usage error, which rank 0 meets too: give it time to print its report before this rank's exit makes
            # torchrun end the job (rank 0's exit ends this wait first)
            time.sleep(USAGE_ERROR_GRACE_S)
        raise
    return cfg, known.dry_run


def import_components(args: list[str], config_type: type) -> list[str]:
    """The command line with every component named by import path (``FIELD:pkg.mod:Class`` or
    ``FIELD:path/to/file.py:Class``) imported and written by its registered name (``FIELD:name``), as tyro reads it.
    A spec that does not import, or names a class of another kind, is an error naming the field and the spec."""
    fields = {path.replace("_", "-"): (path, reg) for path, reg in picked_paths(config_type).items()}
    out = []
    for arg in args:
        head, sep, spec = arg.partition(":")
        picked = fields.get(head.replace("_", "-")) if sep and not arg.startswith("-") else None
        if picked is None or ":" not in spec or spec in picked[1]:
            out.append(arg)
            continue
        path, registry = picked
        try:
            cls = registry.resolve(spec, field_name=path)
        except (OSError, ValueError) as e:
            raise UserError(str(e)) from None
        out.append(f"{head}:{cls.name}")
    return out


def name_negated_components(args: list[str], default) -> list[str]:
    """The command line with the component of every negated boolean flag (``--actor.engine.no-cpu-offload``) named
    first (``actor.engine:fsdp``, the config's own choice) where the line does not name it. tyro 1.0 reads a
    component's options without its name, except the negated flags: alone, those were "Unrecognized options". Naming
    the config's own choice keeps the config's values of that component, as tyro does for its other options."""
    paths = {path.replace("_", "-"): path for path in picked_paths(type(default))}
    named = {a.partition(":")[0].replace("_", "-") for a in args if ":" in a and not a.startswith("-")}
    first = []
    for arg in args:
        head, _, leaf = arg[2:].partition("=")[0].replace("_", "-").rpartition(".")
        if not arg.startswith("--") or not leaf.startswith("no-") or head not in paths or head in named:
            continue
        choice = operator.attrgetter(paths[head])(default)
        if choice is not None:
            first.append(f"{head}:{type(choice).name}")
            named.add(head)
    return first + args


def flatten(cfg, prefix: str = "") -> dict[str, object]:
    """``{"section.field": value}`` of a (nested) config dataclass. A component picked by name (a field typed as a
    union of them: ``actor.policy_loss``, ``actor.engine``, ``algorithm.adv_estimator``, ...) stays whole, so its
    class shows."""
    out = {}
    picked = picked_fields(type(cfg))
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v) and f.name not in picked:
            out.update(flatten(v, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = v
    return out


def start(
    cfg, *, dist: DistConfig, mesh: MeshConfig, seed: int, deterministic: bool = False, dry_run: bool = False
) -> tuple[Runtime, RoleMeshes] | None:
    """Process groups, seeds and meshes for ``cfg`` (the whole config, printed by ``--dry-run``). Returns None after a
    dry run (config and layout printed, process groups closed)."""
    rt = init_distributed(dist)
    quiet_libraries()
    seed_everything(seed)
    set_deterministic(deterministic)
    dims = ParallelDims.from_config(mesh, rt.world_size)
    meshes = RoleMeshes(dims, rt.device.type, rt.rank)
    if rt.is_main:
        if dry_run:
            print("\n".join(f"{k} = {v!r}" for k, v in flatten(cfg).items()))
        print(f"backend {rt.backend}, device {rt.device.type}\n{dims.layout()}", flush=True)
    if dry_run:
        shutdown()
        return None
    return rt, meshes
