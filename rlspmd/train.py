"""Entry point: config file + command-line overrides -> runtime and meshes -> trainer.fit().

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/grpo.py --actor.optim.lr 1e-6
    python -m rlspmd.train --config configs/quickstart.py          # one process, for pdb
    python -m rlspmd.train --config configs/quickstart.py --help   # every field with its docstring
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/ppo.py:cpu  # FILE:NAME picks another object

``--dry-run`` checks the config (not its files), builds the meshes, prints the resolved config and the role/mesh layout,
and exits.
``--resume auto|none|PATH`` is short for ``--checkpoint.resume``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import tyro

from rlspmd.config import Config, load_config_file
from rlspmd.distributed.mesh import ParallelDims, RoleMeshes
from rlspmd.distributed.progress import progress
from rlspmd.distributed.runtime import (
    exit_process, init_distributed, quiet_libraries, seed_everything, set_deterministic, shutdown, spmd_main, start_hang_monitor,
)
from rlspmd.validate import check_config


def parse_args(argv: list[str] | None, config_type: type = Config, prog: str = "rlspmd.train"):
    """``--config FILE``, ``--dry-run`` and ``--resume`` first, then tyro applies the remaining ``--section.field`` overrides."""
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
    description = (
        f"{prog}: --config FILE[:NAME] (a Python file defining `config`, or the object NAME), --dry-run, "
        "--resume auto|none|PATH, then overrides of any field below."
    )
    quiet = os.environ.get("RANK", "0") != "0"  # every rank parses the same argv; let rank 0 report problems
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull if quiet else sys.stderr):
        cfg = tyro.cli(config_type, default=default, args=rest, description=description, prog=prog)
    return cfg, known.dry_run


def flatten(cfg, prefix: str = "") -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out.update(flatten(v, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = v
    return out


@spmd_main
def main(argv: list[str] | None = None) -> None:
    cfg, dry_run = parse_args(argv)
    # Every rank, before anything loads; a dry run previews a layout, maybe before the data and model are in place.
    check_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), check_files=not dry_run)
    if cfg.rollout.engine == "vllm":  # vLLM's environment must be set before the first NCCL communicator
        from third_party.vllm_adapter import prepare_environment

        prepare_environment()
    rt = init_distributed(cfg.dist)
    start_hang_monitor(cfg.dist, rt)
    quiet_libraries()
    seed_everything(cfg.trainer.seed)
    set_deterministic(cfg.trainer.deterministic)
    dims = ParallelDims.from_config(cfg.mesh, rt.world_size)
    meshes = RoleMeshes(dims, rt.device.type, rt.rank)
    if rt.is_main:
        print("\n".join(f"{k} = {v!r}" for k, v in flatten(cfg).items()) if dry_run else "", end="\n" if dry_run else "")
        print(f"backend {rt.backend}, device {rt.device.type}\n{dims.layout()}", flush=True)
    if dry_run:
        shutdown()
        return
    if rt.is_main:
        out = Path(cfg.trainer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
    from rlspmd.trainer.rl import build_program  # heavy imports after the cheap checks

    with progress.stage("startup"):
        program = build_program(cfg, rt, meshes)
    program.fit()
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
