"""Tensor parallel + FSDP2 (``mesh.actor_tp``) against one rank on the same global batch (CPU, Gloo).

usage: tp_check.py MODE OUT_DIR MODEL_DIR

* ``single`` (1 rank, ``actor_tp=1``): the whole batch on one FSDP engine; then loads ``parallel``'s checkpoint
  (run it first) into a fresh 1-D engine.
* ``parallel`` (4 ranks, ``actor_tp=2``: a 2 dp x 2 tp mesh, ranks {0,1} and {2,3} are TP groups), each rank with its
  own quarter of the batch, as the trainer dispatches it.

Both build the engines as the trainer does (``FSDPConfig.build``: meta-device model, sharded load from
the safetensors, activation checkpointing on, float32) and record, under HF names and as full tensors: the policy's
log-probs and entropy, one PPO update's global loss, gradient norm, gradients (as the optimiser saw them, clipped)
and parameters after the step, and the critic's values. ``parallel`` also records the weight stream (every rank's
tensors) and the full state dict, and checks a DCP save / load into a fresh 2-D engine.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from rlspmd.algorithms import AggArgs
from rlspmd.config import DistConfig, FSDPConfig, MeshConfig, ModelConfig, OptimConfig
from rlspmd.distributed.dispatch import all_reduce_sum
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.protocol import Batch
from rlspmd.roles.base import UpdatePlan, ppo_updates
from rlspmd.roles.policy import compute_logprobs

from batches import TEMPERATURE, B, R, global_batch, policy_loss  # tests/dist, the script's directory, is on sys.path
# eps 1e-4: AdamW's first step divides by |g|, which turns float rounding of near-zero gradient entries into
# update differences of up to lr / eps times it; at 1e-4 that stays far below the 1e-5 tolerance on the weights.
OPTIM = OptimConfig(lr=1e-3, eps=1e-4, grad_clip=0.5, warmup_steps=1, schedule="cosine")
FP32 = FSDPConfig(param_dtype="float32")


def engine(kind: str, model_dir: str, *, mesh, train_mesh, optim, sharded_load: bool = True):
    model = ModelConfig(path=model_dir, gradient_checkpointing=True, sharded_load=sharded_load)
    return FP32.build(kind, model_dir, model=model, mesh=mesh, device=torch.device("cpu"), optim=optim,
                      total_optim_steps=4, gradient_checkpointing=True, seed=7, field_name="m", section="actor",
                      train_mesh=train_mesh)


def full(t) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def gather_rows(x: torch.Tensor, mesh) -> torch.Tensor:
    """The data mesh's rows in rank order (every rank holds B / world of them)."""
    parts = [torch.empty_like(x) for _ in range(mesh.size())]
    dist.all_gather(parts, x.contiguous(), group=mesh.get_group())
    return torch.cat(parts)


def run(model_dir: str, out_dir: Path, rt, *, tp: int) -> dict:
    meshes = RoleMeshes(ParallelDims.from_config(MeshConfig(actor_tp=tp), rt.world_size), "cpu", rt.rank)
    mesh, train_mesh = meshes.get("actor", DP), meshes.train_mesh("actor")
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    n = B // rt.world_size
    local = global_batch(vocab, seed=1).slice(rt.rank * n, (rt.rank + 1) * n)
    policy = engine("policy", model_dir, mesh=mesh, train_mesh=train_mesh, optim=OPTIM)
    names = [k for k, _ in policy.module.named_parameters()]
    out = {"names": names}
    lp, ent = compute_logprobs(policy.module, local, micro_batch_size=1, temperature=TEMPERATURE, with_entropy=True,
                               mesh=mesh)
    out["logprobs"], out["entropy"] = gather_rows(lp, mesh), gather_rows(ent, mesh)
    losses = []

    def loss_fn(module, mb: Batch, agg: AggArgs) -> torch.Tensor:
        loss = policy_loss(module, mb, agg)
        losses.append(loss.detach())
        return loss

    plan = UpdatePlan(epochs=1, local_mini_batch=n, micro_batch_size=1, max_tokens=None, loss_agg_mode="token-mean",
                      norm_length=R, optim_steps=4, single_update=True)
    (stats,) = list(ppo_updates(policy, local, loss_fn, plan))
    out["loss"] = float(all_reduce_sum(torch.stack(losses).sum()[None], mesh=mesh)[0])  # each rank's share, summed
    out["grad_norm"] = float(stats["grad_norm"])
    params = dict(policy.module.named_parameters())
    out["grads"] = {k: full(p.grad) for k, p in params.items()}
    out["params"] = {k: full(p) for k, p in params.items()}
    critic = engine("value", model_dir, mesh=mesh, train_mesh=train_mesh, optim=None)
    with torch.no_grad():
        values = critic.module(local["input_ids_BL"], local["attention_mask_BL"], local["position_ids_BL"], response_len=R)
    out["values"] = gather_rows(values, mesh)
    del critic
    if tp == 1:
        # the 2-D run's checkpoint (run first) loads into this 1-D engine: DCP reshards across TP degrees
        fresh = engine("policy", model_dir, mesh=mesh, train_mesh=None, optim=OPTIM)
        dcp.load({"actor": fresh}, checkpoint_id=str(out_dir / "ckpt_tp"))
        out["resharded"] = {k: full(p) for k, p in fresh.module.named_parameters()}
        return out
    # The weight stream: every rank gets every full tensor; the full state dict (rank 0) to compare against.
    stream = policy.weight_stream(torch.float32)
    out["stream"] = [(name, t.clone()) for name, t in stream]
    out["stream_stats"] = {"gathered_bytes": stream.last.gathered_bytes, "units": stream.last.units}
    out["hf_state_dict"] = policy.hf_state_dict()
    # DCP on the 2-D mesh: save, load into a fresh engine, same weights and AdamW state.
    ckpt = str(out_dir / "ckpt_tp")
    dcp.save({"actor": policy}, checkpoint_id=ckpt)
    fresh = engine("policy", model_dir, mesh=mesh, train_mesh=train_mesh, optim=OPTIM)
    dcp.load({"actor": fresh}, checkpoint_id=ckpt)
    saved, loaded = policy.state_dict(), fresh.state_dict()
    for k, v in saved["model"].items():
        torch.testing.assert_close(full(loaded["model"][k]), full(v), rtol=0, atol=0, msg=lambda m: f"reloaded {k}: {m}")
    for k, st in saved["optim"]["state"].items():
        for s in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(full(loaded["optim"]["state"][k][s]), full(st[s]), rtol=0, atol=0)
    out["dcp_ok"] = len(saved["model"])
    out["placements"] = {k: [str(x) for x in p.placements] for k, p in params.items()}
    out["groups"] = {"tp": train_mesh["tp"].mesh.tolist(), "dp": train_mesh["dp"].mesh.tolist()}
    # the whole-model load path (model.sharded_load=False): TP distributes the loaded tensors, same forward
    whole = engine("policy", model_dir, mesh=mesh, train_mesh=train_mesh, optim=None, sharded_load=False)
    lp, _ = compute_logprobs(whole.module, local, micro_batch_size=2, temperature=TEMPERATURE, mesh=mesh)
    out["logprobs_whole_load"] = gather_rows(lp, mesh)
    return out


@spmd_main
def main():
    mode, out_dir, model_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rt = init_distributed(DistConfig())
    results = run(model_dir, out_dir, rt, tp={"single": 1, "parallel": 2}[mode])
    if mode == "single" or rt.rank in (0, 3):  # rank 3: another TP group's second rank (its weight stream)
        torch.save(results, out_dir / f"{mode}_rank{rt.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()
