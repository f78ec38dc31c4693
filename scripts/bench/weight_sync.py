"""Weight-sync benchmark: seconds and bytes moved per sync, per placement and engine. Prints JSON.

    python scripts/bench/weight_sync.py --model models/tiny --nproc 4 --steps 5

Each scenario runs under its own ``torchrun`` (Gloo on CPU, NCCL on GPU) and builds the actor (FSDP2) and the
rollout exactly as the trainer does (``build_rollout``), then times ``sync_weights`` ``--steps`` times:

* ``native_colocated_in_place``: the native engine reads the actor's gathered weights: nothing moves.
* ``native_colocated_streamed``: the native engine keeps its own copy in ``--stream-dtype`` (a dtype other than
  the actor's compute dtype), loaded from the weight stream: one all-gather per unit.
* ``native_split``: actor on the first half of the ranks, rollout on the second: gather on the actor mesh, then
  broadcast from the actor's first rank to the rollout ranks.
* ``vllm_colocated``: only where vLLM and CUDA are available.

Per scenario: ``sync_s`` (mean over steps after the first, rank 0's wall time; ``sync_s_first`` separately), and
the per-step byte counts the trainer logs (``weight_sync/*``), plus the model size in the rollout dtype.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenarios(nproc: int, stream_dtype: str) -> dict[str, list[str]]:
    half = nproc // 2
    out = {
        "native_colocated_in_place": [],
        "native_colocated_streamed": ["--rollout-dtype", stream_dtype],
    }
    if nproc >= 2:
        out["native_split"] = ["--actor-ranks", f"0-{half - 1}", "--rollout-ranks", f"{half}-{nproc - 1}"]
    import torch

    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        out["vllm_colocated"] = ["--engine", "vllm"]
    return out


def launch(args) -> dict:
    results = {}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    for name, extra in scenarios(args.nproc, args.stream_dtype).items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(args.nproc),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(_free_port()),
                __file__,
                "--worker",
                "--model",
                args.model,
                "--steps",
                str(args.steps),
                "--out",
                str(out),
                *extra,
            ]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                errors = [
                    line for line in proc.stderr.splitlines() if "Error" in line and "ChildFailedError" not in line
                ]
                results[name] = {"error": errors[-1] if errors else proc.stderr[-2000:]}
                continue
            results[name] = json.loads(out.read_text())
    return {"model": args.model, "world_size": args.nproc, "steps": args.steps, "scenarios": results}


def worker(args) -> None:
    import torch

    from rlspmd.config import ActorConfig, DistConfig, MeshConfig, ModelConfig, RolloutConfig
    from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
    from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown
    from rlspmd.engines.base import compute_dtype
    from rlspmd.models.loader import eos_token_ids, load_tokenizer
    from rlspmd.metrics import MetricBuffer
    from rlspmd.trainer.build_models import actor_plan, build_policy
    from rlspmd.rollout.base import ROLLOUT_ENGINES
    from rlspmd.trainer.build_rollout import build_rollout

    engine = ROLLOUT_ENGINES[args.engine]()
    engine.prepare_process()
    rt = init_distributed(DistConfig())
    meshes = RoleMeshes(
        ParallelDims.from_config(
            MeshConfig(actor_ranks=args.actor_ranks, rollout_ranks=args.rollout_ranks), rt.world_size
        ),
        rt.device.type,
        rt.rank,
    )
    tok = load_tokenizer(args.model, field_name="--model")
    n_actor = len(meshes.dims.role_ranks["actor"])
    actor_cfg = ActorConfig(model=ModelConfig(path=args.model), mini_batch_size=n_actor, micro_batch_size=1)
    policy = None
    if meshes.hosts("actor"):
        plan = actor_plan(
            actor_cfg, samples_per_prompt=1, train_batch_size=n_actor, dp=n_actor, max_response_length=16, total_steps=1
        )
        policy = build_policy(actor_cfg, mesh=meshes.get("actor", DP), device=rt.device, plan=plan, temperature=1.0)
    cfg = RolloutConfig(engine=engine, dtype=args.rollout_dtype, max_response_length=16)
    rollout = build_rollout(
        cfg,
        meshes=meshes,
        policy=policy,
        model_path=args.model,
        compute=compute_dtype(actor_cfg.engine.param_dtype, rt.device),
        eos_ids=eos_token_ids(args.model, tok),
        pad_id=tok.pad_token_id,
        device=rt.device,
        seed=0,
        max_prompt_length=64,
    )
    times, metrics = [], []
    for _ in range(args.steps):  # every rank: in split placement the rollout ranks receive the syncs
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        buffer = MetricBuffer()
        rollout.sync_weights(buffer)
        metrics.append(buffer.reduce(mesh=None))
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rt.rank == 0:
        dtype = (
            compute_dtype(actor_cfg.engine.param_dtype, rt.device)
            if args.rollout_dtype == "auto"
            else getattr(torch, args.rollout_dtype)
        )
        n_params = sum(p.numel() for p in policy.engine.hf_model.parameters())
        steady = times[1:] or times
        last = metrics[-1]
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": rt.device.type,
                    "rollout_dtype": str(dtype).removeprefix("torch."),
                    "model_bytes": n_params * torch.empty((), dtype=dtype).element_size(),
                    "sync_s": statistics.mean(steady),
                    "sync_s_first": times[0],
                    **{k: last[k] for k in sorted(last) if k.startswith("weight_sync/")},
                }
            )
        )
    shutdown()
    exit_process()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny", help="Hugging Face model directory")
    p.add_argument("--nproc", type=int, default=2, help="world size (ranks)")
    p.add_argument("--steps", type=int, default=5, help="syncs per scenario")
    p.add_argument("--stream-dtype", default="bfloat16", help="rollout dtype of the streamed scenario")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="native", help=argparse.SUPPRESS)
    p.add_argument("--rollout-dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--actor-ranks", default="all", help=argparse.SUPPRESS)
    p.add_argument("--rollout-ranks", default="all", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        print(json.dumps(launch(args), indent=2))


if __name__ == "__main__":
    main()
