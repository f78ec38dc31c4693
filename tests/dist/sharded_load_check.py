"""Sharded loading (meta device, then each rank reads its slices) against today's path (every rank loads the whole
model with ``from_pretrained``, FSDP2 keeps its shard): the same parameters and buffers, bit for bit, for every role
module kind; and each path's peak host memory (VmHWM) on this rank.

usage: sharded_load_check.py OUT.pt KIND:MODEL_DIR[:DTYPE] ...      KIND: policy | value | scorer
       sharded_load_check.py --rss OUT.json MODE MODEL_DIR           MODE: full | sharded (one path per process)

Rank 0 saves ``{spec: {"full": state, "sharded": state, "buffers": (full, sharded)}}`` (full tensors), or with
``--rss`` every rank's ``{"before": VmRSS, "peak": VmHWM, "after": VmRSS, "local_param_bytes"}`` in bytes.
"""

import json
import sys

import torch
import torch.distributed as dist

from rlspmd.config import DistConfig, FSDPConfig, MeshConfig, ModelConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.engines.fsdp import fsdp_role_module


def status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` (peak resident set) of this process, in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def engine(kind: str, path: str, *, dtype: str, sharded: bool, mesh, device) -> FSDPEngine:
    model = ModelConfig(path=path, dtype=dtype, sharded_load=sharded)
    module, weights = fsdp_role_module(kind, path, model=model, seed=5, field_name="model.path")
    return FSDPEngine(module, module.hf, mesh=mesh, device=device, fsdp=FSDPConfig(), optim=None, weights=weights)


@spmd_main
def main():
    rt = init_distributed(DistConfig())
    mesh = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    if sys.argv[1] == "--rss":
        out, mode, path = sys.argv[2:5]
        # Both paths first import transformers' modeling code (~40 MB here): build the model on meta once, so that
        # ``before`` holds it and the difference is the loading alone.
        fsdp_role_module("policy", path, model=ModelConfig(path=path), field_name="model.path")
        before = status_bytes("VmRSS")
        e = engine("policy", path, dtype="float32", sharded=mode == "sharded", mesh=mesh, device=rt.device)
        record = {"before": before, "peak": status_bytes("VmHWM"), "after": status_bytes("VmRSS"),
                  "local_param_bytes": sum(p.to_local().numel() * p.element_size() for p in e.module.parameters())}
        records = [None] * rt.world_size
        dist.all_gather_object(records, record)
        if rt.rank == 0:
            json.dump(records, open(out, "w"))
        shutdown()
        return
    results = {}
    for spec in sys.argv[2:]:
        kind, path, *rest = spec.split(":")
        dtype = rest[0] if rest else "float32"
        engines = [engine(kind, path, dtype=dtype, sharded=s, mesh=mesh, device=rt.device) for s in (False, True)]
        states = [e.full_state_dict() for e in engines]
        buffers = [{k: b.clone() for k, b in e.module.named_buffers()} for e in engines]
        results[spec] = {"full": states[0], "sharded": states[1], "buffers": tuple(buffers),
                         "dtypes": [sorted({str(p.dtype) for p in e.module.parameters()}) for e in engines]}
    if rt.rank == 0:
        torch.save(results, sys.argv[1])
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()
