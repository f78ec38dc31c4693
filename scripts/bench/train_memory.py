"""Peak memory of one training update of the FSDP2 engine with activation checkpointing, CPU offload and tensor
parallelism switched on and off. Prints JSON.

    python scripts/bench/train_memory.py                        # a random ~50M Llama-shaped model (built once), 2 ranks
    python scripts/bench/train_memory.py --configs ac=0,offload=0,tp=1 ac=1,offload=0,tp=1 --rows 8 --seq 512

Each configuration runs under its own ``torchrun`` (fresh processes, so the high-water marks are its own): the actor
engine is built as the trainer builds it (meta device, sharded load, float32), then one optimiser step runs over
``--rows`` rows of ``--seq`` random tokens per rank (one micro-batch, the whole sequence a response: the policy's
log-prob loss). Per rank it records the resident set before the update and its peak (``VmHWM``) after; on CUDA also
``torch.cuda.max_memory_allocated`` of the update. Reported per configuration: the largest values over ranks.

What the figures mean on CPU: activation checkpointing lowers the peak (activations of all layers are not kept for
backward); CPU offload cannot lower *host* memory (on CPU everything is host memory already; it exists to free GPU
memory, which only the CUDA figure shows); ``tp=2`` halves each rank's share of the layer weights (the
embedding/LM head stay whole over ``tp``) but runs the TP group's rows together, so activations per rank grow.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

DEFAULT_CONFIGS = [
    "ac=0,offload=0,tp=1",
    "ac=1,offload=0,tp=1",
    "ac=0,offload=1,tp=1",
    "ac=1,offload=1,tp=1",
    "ac=0,offload=0,tp=2",
    "ac=1,offload=0,tp=2",
]


def parse(spec: str) -> dict[str, int]:
    out = dict(part.split("=") for part in spec.split(","))
    return {"ac": int(out.get("ac", 0)), "offload": int(out.get("offload", 0)), "tp": int(out.get("tp", 1))}


def worker(spec: str, model: str, out: str, rows: int, seq: int) -> None:
    import torch
    from load_memory import status_bytes, write_records

    from rlspmd.config import DistConfig, FSDPConfig, MeshConfig, ModelConfig, OptimConfig
    from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
    from rlspmd.distributed.runtime import init_distributed, shutdown

    c = parse(spec)
    rt = init_distributed(DistConfig())
    meshes = RoleMeshes(ParallelDims.from_config(MeshConfig(actor_tp=c["tp"]), rt.world_size), rt.device.type, rt.rank)
    engine = FSDPConfig(cpu_offload=bool(c["offload"])).build(
        "policy",
        model,
        model=ModelConfig(path=model, gradient_checkpointing=bool(c["ac"])),
        mesh=meshes.get("actor", DP),
        device=rt.device,
        optim=OptimConfig(lr=1e-5),
        gradient_checkpointing=bool(c["ac"]),
        field_name="model",
        section="actor",
        train_mesh=meshes.train_mesh("actor"),
    )
    vocab = engine.hf_model.config.vocab_size
    g = torch.Generator().manual_seed(rt.rank)
    ids = torch.randint(3, vocab, (rows, seq), generator=g).to(rt.device)
    mask = torch.ones_like(ids)
    pos = torch.arange(seq, device=rt.device).expand(rows, seq).contiguous()
    R = seq - 1

    def loss_fn(module, _mb):
        logp, _ = module(ids, mask, pos, response_len=R, with_entropy=False)
        return -logp.sum() / (rows * R * meshes.get("actor", DP).size())

    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = status_bytes("VmRSS")
    engine.optimizer_step([None], loss_fn)
    rec = {
        "before": before,
        "peak": status_bytes("VmHWM"),
        "cuda_peak": torch.cuda.max_memory_allocated() if rt.device.type == "cuda" else None,
        "local_param_bytes": sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters()),
    }
    write_records(rec, out)
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: build the random ~50M model)")
    p.add_argument("--build-dir", default=str(ROOT / "models" / "bench-50m"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rows", type=int, default=4, help="rows per rank in the update")
    p.add_argument("--seq", type=int, default=512, help="tokens per row")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="ac=0|1,offload=0|1,tp=N each")
    p.add_argument("--worker", nargs=5, metavar=("SPEC", "MODEL", "OUT", "ROWS", "SEQ"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec, model, out, rows, seq = args.worker
        return worker(spec, model, out, int(rows), int(seq))
    from common import emit
    from load_memory import build_model, launch_workers

    model = args.model or str(
        build_model(
            Path(args.build_dir), hidden=512, layers=8, heads=8, kv_heads=4, inter=1408, vocab=16384, dtype="float32"
        )
    )
    result: dict = {
        "benchmark": "train_memory",
        "model": model,
        "nproc": args.nproc,
        "rows_per_rank": args.rows,
        "seq": args.seq,
        "runs": {},
    }
    for spec in args.configs:
        recs = launch_workers(
            __file__, args.nproc, lambda out, spec=spec: [spec, model, out, str(args.rows), str(args.seq)]
        )
        cuda = [r["cuda_peak"] for r in recs if r["cuda_peak"] is not None]
        result["runs"][spec] = {
            "peak_rss_bytes": max(r["peak"] for r in recs),
            "update_added_rss_bytes": max(r["peak"] - r["before"] for r in recs),
            "local_param_bytes": max(r["local_param_bytes"] for r in recs),
            "cuda_peak_bytes": max(cuda) if cuda else None,
        }
    emit(result)


if __name__ == "__main__":
    main()
