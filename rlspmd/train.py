"""Entry point: config file + command-line overrides -> runtime and meshes -> roles -> trainer.fit().

    torchrun --nproc-per-node 8 -m rlspmd.train --config configs/grpo.py --actor.optim.lr 1e-6
    python -m rlspmd.train --config configs/quickstart.py          # one process, for pdb
    python -m rlspmd.train --config configs/quickstart.py --help   # every field with its docstring
    torchrun --nproc-per-node 2 -m rlspmd.train --config configs/ppo.py:cpu  # FILE:NAME picks another object

``--dry-run`` builds the meshes, prints the resolved config and the role/mesh layout, and exits.
``--resume auto|none|PATH`` is short for ``--checkpoint.resume``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlspmd.distributed.progress import progress
from rlspmd.distributed.runtime import exit_process, shutdown, spmd_main, start_hang_monitor
from rlspmd.config import to_dict
from rlspmd.startup import parse_args, start
from rlspmd.validate import check_config, ignored_settings


@spmd_main
def main(argv: list[str] | None = None) -> None:
    cfg, dry_run = parse_args(argv)
    # Every rank, before anything loads; a dry run previews a layout, maybe before the data and model are in place.
    check_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), check_files=not dry_run)
    cfg.rollout.engine.prepare_process()  # e.g. vLLM's environment, set before the first NCCL communicator
    started = start(
        cfg,
        dist=cfg.dist,
        mesh=cfg.mesh,
        seed=cfg.trainer.seed,
        deterministic=cfg.trainer.deterministic,
        dry_run=dry_run,
    )
    if started is None:
        return
    rt, meshes = started
    start_hang_monitor(cfg.dist, rt)
    if rt.is_main:
        out = Path(cfg.trainer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
    from rlspmd.trainer.build import build_trainer  # heavy imports after the cheap checks

    with progress.stage("startup"):
        trainer = build_trainer(cfg, rt, meshes, warnings=ignored_settings(cfg))
    trainer.fit()
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
