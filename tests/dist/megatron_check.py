"""The megatron engine against the FSDP engine on the same HF weights and data (CPU, Gloo), results saved for the test.

usage: megatron_check.py MODE OUT_DIR MODEL_DIR [MODEL_DIR ...]

* ``single`` (1 rank): per model, log-probs/entropy of both engines; one update (PPO clip + k3 KL + entropy bonus,
  through ``ppo_updates``, 2-row micro-batches, clipping active): grad norm, AdamW's first moment (0.1 x the
  clipped gradient) and the updated weights, all under HF names. Values of the critic (value head seeded alike).
  For the first model: 3 updates straight vs 2 updates + DCP save + load into a fresh engine + 1 update, the
  export read-back of the saved checkpoint (as ``scripts/export_hf.py`` reads it), and an HF directory written with
  the trainer's ``save_hf_model``, loaded back as an HF model.
* ``parallel`` (2 ranks, each with its own half of the batch): the FSDP engine over both ranks, megatron with
  ``tp=2`` and megatron with ``dp=2``, the same update; the TP engine's weight stream; the TP engine's checkpoint.
* ``reshard`` (1 rank): a ``tp=1`` megatron engine loads the ``parallel`` run's TP checkpoint (``ckpt_tp2``; or the
  checkpoint named by a 4th argument).
* ``pipeline_ref`` (1 rank) and ``pipeline`` (2 ranks, ``pp=2``, each rank with its own half of the batch): per model,
  megatron's log-probs/entropy and one update (grad norm, weights and AdamW state of the rank's stage); the critic's
  values; the weight stream after the update; a ``pp=2`` checkpoint (``ckpt_pp2_tp1``) and its state loaded into a
  fresh ``pp=2`` engine. The reference runs ``pp=1`` on one rank with the whole batch. ``pipeline_tp`` (4 ranks):
  the same with ``pp=2`` x ``tp=2`` (``ckpt_pp2_tp2``).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from rlspmd.config import DistConfig, FSDPConfig, MegatronConfig, MeshConfig, OptimConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.engines.fsdp import FSDPEngine
from rlspmd.engines.megatron import MegatronEngine, build_megatron_module
from rlspmd.roles.base import UpdatePlan, ppo_updates
from rlspmd.models.loader import load_tokenizer
from rlspmd.models.value import load_value_model
from rlspmd.protocol import Batch
from rlspmd.models.sharded_load import build_policy_module
from rlspmd.trainer.checkpoint import save_hf_model

from batches import TEMPERATURE, B, R, global_batch, policy_loss  # tests/dist, the script's directory, is on sys.path
OPTIM = OptimConfig(lr=1e-3, grad_clip=0.5, warmup_steps=1, schedule="cosine")
FP32 = FSDPConfig(param_dtype="float32")  # float32 compute on GPUs too, so the engines can be compared tightly


def update(engine, local: Batch, mesh) -> float:
    assert engine.mesh is mesh
    plan = UpdatePlan(epochs=1, local_mini_batch=len(local), micro_batch_size=2, max_tokens=None, loss_agg_mode="token-mean",
                      norm_length=R, optim_steps=1, single_update=True)
    return float(list(ppo_updates(engine, local, policy_loss, plan))[0]["grad_norm"])


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train_state(engine) -> dict:
    """Weights and AdamW state as full tensors under HF names (collective over DTensor meshes)."""
    sd = engine.state_dict()
    out = {"lr": engine.lr, "model": {k: full(v) for k, v in sd["model"].items()}}
    for k in ("exp_avg", "exp_avg_sq", "step"):
        out[k] = {name: full(st[k]) for name, st in sd["optim"]["state"].items()}
    return out


def fsdp_policy(model_dir: str, mesh, rt) -> FSDPEngine:
    module = build_policy_module(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model", packing=True)
    return FSDPEngine(module, module.hf, mesh=mesh, device=rt.device, fsdp=FP32, optim=OPTIM, total_optim_steps=4)


def megatron_engine(kind: str, model_dir: str, mesh, rt, *, cfg: MegatronConfig, optim=None, total_optim_steps: int = 1,
                    seed: int = 0) -> MegatronEngine:
    """As the trainer's builder makes it: the module, then the engine around it."""
    module = build_megatron_module(kind, model_dir, mesh=mesh, device=rt.device, cfg=cfg, seed=seed)
    return MegatronEngine(module, mesh=mesh, optim=optim, total_optim_steps=total_optim_steps)


def megatron_policy(model_dir: str, mesh, rt, *, tp: int = 1, pp: int = 1):
    return megatron_engine("policy", model_dir, mesh, rt, cfg=MegatronConfig(tp=tp, pp=pp, param_dtype="float32"),
                           optim=OPTIM, total_optim_steps=4)


@torch.no_grad()
def forward(engine, batch: Batch):
    return engine.module(batch["input_ids_BL"], batch["attention_mask_BL"], batch["position_ids_BL"], response_len=R,
                         temperature=TEMPERATURE)


def compare_engines(model_dir: str, mesh, rt, engines: dict) -> dict:
    """Forward outputs, then one update, of each engine on this rank's share of the batch."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    n = B // rt.world_size
    local = global_batch(vocab, seed=1).to(rt.device).slice(rt.rank * n, (rt.rank + 1) * n)
    out = {}
    for name, build in engines.items():
        engine = build()
        lp, ent = forward(engine, local)
        grad_norm = update(engine, local, mesh)
        out[name] = {"logprobs": lp, "entropy": ent, "grad_norm": grad_norm, **train_state(engine)}
        del engine
    return out


def single(out_dir: Path, model_dirs: list[str], mesh, rt) -> dict:
    results = {}
    for model_dir in model_dirs:
        results[model_dir] = compare_engines(model_dir, mesh, rt, {
            "fsdp": lambda: fsdp_policy(model_dir, mesh, rt),
            "megatron": lambda: megatron_policy(model_dir, mesh, rt),
        })
    first = model_dirs[0]
    vocab = json.loads((Path(first) / "config.json").read_text())["vocab_size"]
    batch = global_batch(vocab, seed=1).to(rt.device)
    # The critic: values of the same seeded head on the same backbone.
    ref = load_value_model(first, dtype="float32", attn_implementation="sdpa", seed=7, field_name="m", packing=True)
    ref = FSDPEngine(ref, ref.hf, mesh=mesh, device=rt.device, fsdp=FP32, optim=None)
    critic = megatron_engine("value", first, mesh, rt, cfg=MegatronConfig(param_dtype="float32"), seed=7)
    args = (batch["input_ids_BL"], batch["attention_mask_BL"], batch["position_ids_BL"])
    with torch.no_grad():
        results["values"] = {"fsdp": ref.module(*args, response_len=R), "megatron": critic.module(*args, response_len=R)}
    # Exact resume: 3 updates straight vs 2 + save + load into a fresh engine + 1.
    batches = [global_batch(vocab, seed=s).to(rt.device) for s in (11, 12, 13)]
    straight = megatron_policy(first, mesh, rt)
    for b in batches:
        update(straight, b, mesh)
    first_two = megatron_policy(first, mesh, rt)
    for b in batches[:2]:
        update(first_two, b, mesh)
    ckpt = out_dir / "ckpt_single"
    dcp.save({"actor": first_two}, checkpoint_id=str(ckpt))
    saved_full = first_two.full_state_dict()
    resumed = megatron_policy(first, mesh, rt)
    dcp.load({"actor": resumed}, checkpoint_id=str(ckpt))
    update(resumed, batches[2], mesh)
    results["resume"] = {"straight": train_state(straight), "resumed": train_state(resumed)}
    # An HF directory written from the engine (the trainer's save_hf_model) reproduces its log-probs.
    hf_dir = save_hf_model(straight, load_tokenizer(first, field_name="m"), first, out_dir / "hf", is_main=True)
    exported = fsdp_policy(str(hf_dir), mesh, rt)
    results["hf_export"] = {"engine": forward(straight, batch), "hf_dir": forward(exported, batch)}
    # What scripts/export_hf.py reads: the actor's HF-named weights, unsharded.
    request = {"actor.model." + k: torch.empty_like(v) for k, v in saved_full.items()}
    dcp.load(request, checkpoint_id=str(ckpt))
    results["export"] = {"read": {k[len("actor.model."):]: v for k, v in request.items()}, "engine": saved_full}
    return results


def parallel(out_dir: Path, model_dirs: list[str], mesh, rt) -> dict:
    model_dir = model_dirs[0]
    results = compare_engines(model_dir, mesh, rt, {
        "fsdp": lambda: fsdp_policy(model_dir, mesh, rt),
        "megatron_tp2": lambda: megatron_policy(model_dir, mesh, rt, tp=2),
        "megatron_dp2": lambda: megatron_policy(model_dir, mesh, rt, tp=1),
    })
    # The TP engine after one update: its weight stream, its full state dict, and a checkpoint to reshard.
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    engine = megatron_policy(model_dir, mesh, rt, tp=2)
    update(engine, global_batch(vocab, seed=1).to(rt.device).slice(rt.rank * B // 2, (rt.rank + 1) * B // 2), mesh)
    stream = engine.weight_stream(dtype=torch.bfloat16)
    results["stream"] = {"tensors": [(name, t.clone()) for name, t in stream], "gathered_bytes": stream.last.gathered_bytes,
                         "manifest": stream.manifest.names()}
    results["full_state_dict"] = engine.full_state_dict()
    dcp.save({"actor": engine}, checkpoint_id=str(out_dir / "ckpt_tp2"))
    results["tp2_state"] = train_state(engine)
    results["rank"] = [engine.groups.tp_rank, engine.groups.dp_rank]
    return results


def reshard(out_dir: Path, model_dirs: list[str], mesh, rt) -> dict:
    ckpt = model_dirs[1] if len(model_dirs) > 1 else "ckpt_tp2"
    engine = megatron_policy(model_dirs[0], mesh, rt)
    dcp.load({"actor": engine}, checkpoint_id=str(out_dir / ckpt))
    return {"state": train_state(engine)}


def pipeline_run(out_dir: Path, model_dirs: list[str], mesh, rt, *, pp: int, tp: int = 1) -> dict:
    """``pipeline_ref`` (pp=1, 1 rank), ``pipeline`` (pp=2, 2 ranks), ``pipeline_tp`` (pp=2 x tp=2, 4 ranks)."""
    results = {}
    for model_dir in model_dirs:
        results[model_dir] = compare_engines(model_dir, mesh, rt, {"megatron": lambda: megatron_policy(model_dir, mesh, rt, pp=pp, tp=tp)})
    first = model_dirs[0]
    vocab = json.loads((Path(first) / "config.json").read_text())["vocab_size"]
    n = B // rt.world_size
    local = global_batch(vocab, seed=1).to(rt.device).slice(rt.rank * n, (rt.rank + 1) * n)
    critic = megatron_engine("value", first, mesh, rt, cfg=MegatronConfig(tp=tp, pp=pp, param_dtype="float32"), seed=7)
    with torch.no_grad():
        results["values"] = critic.module(local["input_ids_BL"], local["attention_mask_BL"], local["position_ids_BL"],
                                          response_len=R)
    del critic
    engine = megatron_policy(first, mesh, rt, pp=pp, tp=tp)
    update(engine, local, mesh)
    results["stream"] = [(name, t.clone()) for name, t in engine.weight_stream(dtype=torch.float32)]
    results["full_state_dict"] = engine.full_state_dict()
    results["param_shapes"] = engine.param_shapes()
    if pp > 1:
        try:  # with autograd a pipelined module call is refused (training goes through optimizer_step)
            engine.module(local["input_ids_BL"], local["attention_mask_BL"], local["position_ids_BL"], response_len=R)
        except RuntimeError as e:
            results["grad_call"] = str(e)
        dcp.save({"actor": engine}, checkpoint_id=str(out_dir / f"ckpt_pp{pp}_tp{tp}"))
        results["saved"] = train_state(engine)
        update(engine, local, mesh)
        resumed = megatron_policy(first, mesh, rt, pp=pp, tp=tp)
        dcp.load({"actor": resumed}, checkpoint_id=str(out_dir / f"ckpt_pp{pp}_tp{tp}"))
        update(resumed, local, mesh)
        results["resume"] = {"straight": train_state(engine), "resumed": train_state(resumed)}
    return results


def pipeline_ref(out_dir: Path, model_dirs: list[str], mesh, rt) -> dict:
    return pipeline_run(out_dir, model_dirs, mesh, rt, pp=1)


def pipeline(out_dir: Path, model_dirs: list[str], mesh, rt) -> dict:
    return pipeline_run(out_dir, model_dirs, mesh, rt, pp=2)


def pipeline_tp(out_dir: Path, model_dirs: list[str], mesh, rt) -> dict:
    return pipeline_run(out_dir, model_dirs, mesh, rt, pp=2, tp=2)


@spmd_main
def main():
    mode, out_dir, model_dirs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    rt = init_distributed(DistConfig())
    mesh = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), rt.device.type, rt.rank).get("actor", DP)
    modes = {"single": single, "parallel": parallel, "reshard": reshard, "pipeline_ref": pipeline_ref, "pipeline": pipeline,
             "pipeline_tp": pipeline_tp}
    results = modes[mode](out_dir, model_dirs, mesh, rt)
    torch.save(results, out_dir / f"{mode}_rank{rt.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()
