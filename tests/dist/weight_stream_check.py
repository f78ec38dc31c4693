"""The weight stream on 2 or 4 ranks (Gloo): tensors equal the full state dict, names and order agree across ranks,
tied weights are sent once, shards are cast before the gather, at most one gathered unit is alive at a time, and
(4 ranks) the split-placement bridge delivers the same tensors to disjoint rollout ranks.

    torchrun --nproc-per-node N weight_stream_check.py MODEL_DIR
"""

import sys
import time
import weakref

import torch
import torch.distributed as dist

from rlspmd.config import DistConfig, FSDPConfig, MeshConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.models.loader import load_causal_lm
from rlspmd.models.policy import CausalLMPolicy
from rlspmd.rollout.native import OwnWeights
from rlspmd.engines.weight_stream import WeightStream
from rlspmd.rollout.weight_sync import WeightBridge


class GatherProbe:
    """Wraps the flat all-gather the stream calls: records input dtypes and the bytes of gathered buffers alive at once."""

    NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def __init__(self):
        self.real = getattr(dist, self.NAME)
        self.input_dtypes: list[torch.dtype] = []
        self.live = 0
        self.peak_live = 0
        self.largest = 0

    def __call__(self, out, inp, *args, **kwargs):
        self.input_dtypes.append(inp.dtype)
        # Gloo's worker thread may hold the previous output for a moment after wait() returned; give it a second.
        # A buffer the stream itself still references stays alive and is counted.
        deadline = time.monotonic() + 1.0
        while self.live and time.monotonic() < deadline:
            time.sleep(0.005)
        n = out.numel() * out.element_size()
        self.live += n
        self.peak_live = max(self.peak_live, self.live)
        self.largest = max(self.largest, n)
        weakref.finalize(out, self._free, n)
        return self.real(out, inp, *args, **kwargs)

    def _free(self, n):
        self.live -= n


def check_stream(stream: WeightStream, ref: dict, *, dtype, scale: float = 1.0) -> list[str]:
    """Consume the stream holding one tensor at a time; every tensor equals the reference (cast, scaled)."""
    names = []
    for name, tensor in stream:
        assert name in ref, f"{name} is not in the HF state dict"
        assert tensor.dtype == dtype, (name, tensor.dtype)
        expected = (ref[name] * scale).to(dtype)
        assert torch.equal(tensor, expected), f"{name} differs from the state dict"
        names.append(name)
        del tensor
    return names


@spmd_main
def main():
    model_dir = sys.argv[1]
    rt = init_distributed(DistConfig())
    r, w = rt.rank, rt.world_size
    split = w == 4
    mesh_cfg = MeshConfig(actor_ranks="0-1", rollout_ranks="2-3") if split else MeshConfig()
    meshes = RoleMeshes(ParallelDims.from_config(mesh_cfg, w), "cpu", r)
    plain = load_causal_lm(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model")
    ref = {k: v.clone() for k, v in plain.state_dict().items()}
    tied = plain.config.tie_word_embeddings

    actor_mesh = meshes.get("actor", DP)
    if actor_mesh is not None:
        module = CausalLMPolicy(load_causal_lm(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model"))
        engine = FSDPEngine(module, module.hf, mesh=actor_mesh, device=rt.device, fsdp=FSDPConfig())
        probe = GatherProbe()
        setattr(dist, probe.NAME, probe)
        try:
            stream = WeightStream(engine, dtype=torch.bfloat16)
            names = check_stream(stream, ref, dtype=torch.bfloat16)
        finally:
            setattr(dist, probe.NAME, probe.real)
        # the cast happens on the shard: only bf16 crosses ranks, one gather per unit
        assert probe.input_dtypes == [torch.bfloat16] * len(stream.manifest.units), probe.input_dtypes
        assert probe.peak_live == probe.largest <= stream.manifest.max_unit_bytes, (probe.peak_live, probe.largest)
        assert stream.last.peak_unit_bytes == probe.largest
        full_bytes = sum(v.numel() for k, v in ref.items() if not (tied and k == "lm_head.weight")) * 2
        assert stream.last.tensor_bytes == full_bytes == stream.manifest.nbytes
        assert probe.largest < full_bytes / 2, "a unit must be a part of the model, not all of it"
        # names: every HF weight, tied ones once, in model order, identical on every actor rank
        expected = set(ref) - ({"lm_head.weight"} if tied else set())
        assert set(names) == expected and len(names) == len(expected), set(ref) ^ set(names)
        assert names[0] == "model.embed_tokens.weight" and names[1].startswith("model.layers.0.")
        layer_ids = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
        assert layer_ids == sorted(layer_ids)
        assert ("lm_head.weight" in names) == (not tied)
        all_names = [None] * actor_mesh.size()
        dist.all_gather_object(all_names, names, group=actor_mesh.get_group())
        assert all(n == names for n in all_names)
        # the stream reads the current weights: double every shard and stream again (fp32)
        with torch.no_grad():
            for p in engine.module.parameters():
                p.to_local().mul_(2.0)
        check_stream(WeightStream(engine, dtype=torch.float32), ref, dtype=torch.float32, scale=2.0)

    if split:  # actor 0-1 -> rollout 2-3: gather on the actor mesh, broadcast from rank 0 to ranks 2-3
        bridge = WeightBridge(meshes.link("actor", "rollout", first_only=True), src=0, device=rt.device)
        if actor_mesh is not None:
            bridge.send(WeightStream(engine, dtype=torch.float32))
        else:
            own = OwnWeights(plain)
            loaded = own.load(bridge.receive())
            assert loaded == bridge.manifest.nbytes
            for k, v in own.hf_model.state_dict().items():
                assert torch.equal(v, ref[k] * 2.0), k
            # the tie survives the load: the head is the (updated) embedding
            if tied:
                assert own.hf_model.lm_head.weight.data_ptr() == own.hf_model.model.embed_tokens.weight.data_ptr()
    dist.barrier()
    if r == 0:
        print("WEIGHT STREAM OK", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
