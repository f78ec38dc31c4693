"""Peak host memory per rank of loading a model into the FSDP2 engine: sharded meta-device loading against today's
path (every rank ``from_pretrained`` the whole model, then FSDP2 keeps its shard). Prints JSON.

    python scripts/bench/load_memory.py                       # a random ~0.85B Llama-shaped model (built once), 2 ranks
    python scripts/bench/load_memory.py --model ~/.cache/rlspmd/smollm2-135m-instruct --nproc 2

Each path runs under its own ``torchrun`` (Gloo, CPU); every rank reads its peak resident set (``VmHWM`` in
/proc/self/status) after the engine is built, and its resident set before the load (after importing the model's
code). Reported per path: the largest peak over ranks (``peak_bytes``) and the largest increase over ranks
(``added_bytes``); ``ratio_peak`` / ``ratio_added`` are sharded over full. The target of issue 15 is
``ratio_peak`` <= 0.6 for a 1B-class model on 2 ranks.

The default model (``--build``): hidden 2048, 16 layers, 16/4 heads, intermediate 5632, vocab 32000, untied
(0.85 B parameters), stored in bfloat16 like released checkpoints, loaded into float32 master weights
(``model.dtype`` float32, the training default): 1.7 GB on disk, 3.4 GB in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))


def status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def write_records(rec: dict, out: str) -> None:
    """Worker side: every rank's ``rec``, in rank order, written to ``out`` by rank 0 (collective)."""
    import torch.distributed as dist

    recs = [None] * dist.get_world_size()
    dist.all_gather_object(recs, rec)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(recs))


def launch_workers(script: str, nproc: int, worker_args: Callable[[str], list[str]]) -> list[dict]:
    """Launcher side: ``script --worker *worker_args(out)`` on ``nproc`` local ranks (torchrun, one thread each);
    the ranks' records, as the worker's ``write_records`` left them in ``out``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out = Path(tmp) / "records.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(nproc),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                script,
                "--worker",
                *worker_args(str(out)),
            ],
            check=True,
            env=env,
            cwd=ROOT,
        )
        return json.loads(out.read_text())


def build_model(
    out: Path, *, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, dtype: str
) -> Path:
    """A random Llama-shaped directory, written tensor by tensor (never the whole float32 model in memory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
    )
    cfg.save_pretrained(out)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    g = torch.Generator().manual_seed(0)
    tensors = {
        n: (torch.randn(s, generator=g) * 0.02 if len(s) > 1 else torch.ones(s)).to(getattr(torch, dtype))
        for n, s in shapes.items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def worker(mode: str, model: str, out: str) -> None:
    from rlspmd.config import DistConfig, FSDPConfig, MeshConfig, ModelConfig
    from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
    from rlspmd.distributed.runtime import init_distributed, shutdown
    from rlspmd.engines.fsdp import FSDPEngine
    from rlspmd.engines.fsdp import fsdp_role_module

    rt = init_distributed(DistConfig())
    mesh = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    fsdp_role_module(
        "policy", model, model=ModelConfig(path=model), field_name="model"
    )  # import the model's code first
    before = status_bytes("VmRSS")
    cfg = ModelConfig(path=model, sharded_load=mode == "sharded")
    module, weights = fsdp_role_module("policy", model, model=cfg, field_name="model")
    engine = FSDPEngine(module, module.hf, mesh=mesh, device=rt.device, fsdp=FSDPConfig(), optim=None, weights=weights)
    rec = {
        "before": before,
        "peak": status_bytes("VmHWM"),
        "after": status_bytes("VmRSS"),
        "local_param_bytes": sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters()),
    }
    write_records(rec, out)
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: build the random 0.85B model)")
    p.add_argument("--build-dir", default=str(ROOT / "models" / "bench-0.85b"))
    p.add_argument("--file-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--worker", nargs=3, metavar=("MODE", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    from common import emit

    model = args.model or str(
        build_model(
            Path(args.build_dir),
            hidden=2048,
            layers=16,
            heads=16,
            kv_heads=4,
            inter=5632,
            vocab=32000,
            dtype=args.file_dtype,
        )
    )
    result: dict = {"benchmark": "load_memory", "model": model, "nproc": args.nproc}
    for mode in ("full", "sharded"):
        recs = launch_workers(__file__, args.nproc, lambda out, mode=mode: [mode, model, out])
        result[mode] = {
            "peak_bytes": max(r["peak"] for r in recs),
            "added_bytes": max(r["peak"] - r["before"] for r in recs),
            "before_bytes": max(r["before"] for r in recs),
            "local_param_bytes": max(r["local_param_bytes"] for r in recs),
        }
    result["model_bytes"] = sum(r for r in (result["sharded"]["local_param_bytes"],)) * args.nproc
    result["ratio_peak"] = round(result["sharded"]["peak_bytes"] / result["full"]["peak_bytes"], 3)
    result["ratio_added"] = round(result["sharded"]["added_bytes"] / result["full"]["added_bytes"], 3)
    emit(result)


if __name__ == "__main__":
    main()
