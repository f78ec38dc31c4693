"""Expert parallel + FSDP2 (``mesh.actor_ep``) against FSDP2 alone, on the same 2 ranks and the same per-rank data.

usage: moe_ep_check.py OUT_DIR MODEL_DIR

Builds the policy engine as the trainer does (``FSDPConfig.build``: meta-device model, sharded load
from the per-expert safetensors, activation checkpointing on, float32) twice: ``actor_ep=1`` (the experts FSDP2-
sharded with everything else) and ``actor_ep=2`` (each rank holds 4 of the 8 experts, tokens move by ``all_to_all``).
Each rank holds its own half of the global batch, as the trainer dispatches it. Records, per EP degree: the log-probs
and the routing, 3 PPO updates (policy loss + the load-balancing loss; global loss and gradient norm per step),
the parameters after them (full tensors), the placements of the experts; for ``actor_ep=2`` also the weight stream,
the HF state dict, a DCP save loaded back into a fresh EP engine and into an ``actor_ep=1`` one, a frozen engine's
log-probs (the reference) and the whole-model load path (``model.sharded_load=False``).
"""

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

OPTIM = OptimConfig(lr=1e-3, eps=1e-4, grad_clip=0.5, warmup_steps=1, schedule="cosine")
FP32 = FSDPConfig(param_dtype="float32")
AUX_COEF = 0.01
STEPS = 3


def engine(model_dir: str, *, mesh, expert_mesh, optim, sharded_load: bool = True):
    model = ModelConfig(path=model_dir, gradient_checkpointing=True, sharded_load=sharded_load)
    return FP32.build(
        "policy",
        model_dir,
        model=model,
        mesh=mesh,
        device=torch.device("cpu"),
        optim=optim,
        total_optim_steps=STEPS + 1,
        gradient_checkpointing=True,
        seed=7,
        field_name="m",
        section="actor",
        expert_mesh=expert_mesh,
    )


def full(t) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def gather_rows(x: torch.Tensor, mesh) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(mesh.size())]
    dist.all_gather(parts, x.contiguous(), group=mesh.get_group())
    return torch.cat(parts)


def run(model_dir: str, out_dir: Path, rt, *, ep: int) -> dict:
    meshes = RoleMeshes(ParallelDims.from_config(MeshConfig(actor_ep=ep), rt.world_size), "cpu", rt.rank)
    mesh, expert_mesh = meshes.get("actor", DP), meshes.expert_mesh("actor")
    vocab = 800
    n = B // rt.world_size
    policy = engine(model_dir, mesh=mesh, expert_mesh=expert_mesh, optim=OPTIM)
    out = {"names": [k for k, _ in policy.module.named_parameters()]}
    local = global_batch(vocab, seed=1).slice(rt.rank * n, (rt.rank + 1) * n)
    # micro-batches of 1 row: the ranks' token counts differ in every forward (the all_to_all splits do)
    lp, ent = compute_logprobs(
        policy.module, local, micro_batch_size=1, temperature=TEMPERATURE, with_entropy=True, mesh=mesh
    )
    out["logprobs"], out["entropy"] = gather_rows(lp, mesh), gather_rows(ent, mesh)
    losses = []

    def loss_fn(module, mb: Batch, agg: AggArgs) -> torch.Tensor:
        share = mb["loss_mask_BR"].sum() / agg.global_tokens
        loss = policy_loss(module, mb, agg) + AUX_COEF * module.moe.aux_loss() * share
        losses.append(loss.detach())
        return loss

    plan = UpdatePlan(
        epochs=1,
        local_mini_batch=n,
        micro_batch_size=2,
        max_tokens=None,
        loss_agg_mode="token-mean",
        norm_length=R,
        optim_steps=STEPS + 1,
        single_update=True,
    )
    out["loss"], out["grad_norm"] = [], []
    for step in range(STEPS):
        batch = global_batch(vocab, seed=10 + step).slice(rt.rank * n, (rt.rank + 1) * n)
        losses.clear()
        (stats,) = list(ppo_updates(policy, batch, loss_fn, plan))
        out["loss"].append(float(all_reduce_sum(torch.stack(losses).sum()[None], mesh=mesh)[0]))
        out["grad_norm"].append(float(stats["grad_norm"]))
    params = dict(policy.module.named_parameters())
    out["params"] = {k: full(p) for k, p in params.items()}
    out["placements"] = {k: [str(x) for x in p.placements] for k, p in params.items() if "experts" in k}
    out["local_shapes"] = {k: tuple(p.to_local().shape) for k, p in params.items() if "experts" in k}
    ckpt = str(out_dir / "ckpt_ep")
    if ep == 1:
        if (out_dir / "ckpt_ep").exists():  # the EP run's checkpoint (run first) loads into this FSDP-only engine
            fresh = engine(model_dir, mesh=mesh, expert_mesh=None, optim=OPTIM)
            dcp.load({"actor": fresh}, checkpoint_id=ckpt)
            out["resharded"] = {k: full(p) for k, p in fresh.module.named_parameters()}
        return out
    stream = policy.weight_stream(torch.float32)
    out["stream"] = {name: t.clone() for name, t in stream}
    out["hf_state_dict"] = policy.hf_state_dict()
    dcp.save({"actor": policy}, checkpoint_id=ckpt)
    fresh = engine(model_dir, mesh=mesh, expert_mesh=expert_mesh, optim=OPTIM)
    dcp.load({"actor": fresh}, checkpoint_id=ckpt)
    saved, loaded = policy.state_dict(), fresh.state_dict()
    for k, v in saved["model"].items():
        torch.testing.assert_close(
            full(loaded["model"][k]), full(v), rtol=0, atol=0, msg=lambda m: f"reloaded {k}: {m}"
        )
    for k, st in saved["optim"]["state"].items():
        for s in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full(loaded["optim"]["state"][k][s]), full(st[s]), rtol=0, atol=0)
    out["dcp_ok"] = len(saved["model"])
    # a frozen engine (the reference) and the whole-model load path: the first log-probs again
    for key, kw in (("logprobs_frozen", {}), ("logprobs_whole_load", {"sharded_load": False})):
        other = engine(model_dir, mesh=mesh, expert_mesh=expert_mesh, optim=None, **kw)
        lp, _ = compute_logprobs(other.module, local, micro_batch_size=3, temperature=TEMPERATURE, mesh=mesh)
        out[key] = gather_rows(lp, mesh)
    return out


@spmd_main
def main():
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    rt = init_distributed(DistConfig())
    results = {ep: run(model_dir, out_dir, rt, ep=ep) for ep in (2, 1)}
    torch.save(results, out_dir / f"rank{rt.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()
