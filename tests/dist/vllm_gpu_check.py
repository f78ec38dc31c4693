"""The vLLM engine colocated with an FSDP2 actor on GPU(s). Prints measurements and "VLLM GPU OK".

    torchrun --nproc-per-node 1 vllm_gpu_check.py MODEL_DIR [--tp 2] [--lora]

``--lora``: the actor trains LoRA adapters (``actor.lora.rank=4``); vLLM receives the merged weights through the weight
stream, and the update perturbs the adapters only, so following it means the merge reached vLLM.
"""

import sys

import torch
import torch.distributed as dist

from rlspmd.config import ActorConfig, DistConfig, LoraConfig, MeshConfig, ModelConfig, RolloutConfig, VllmConfig
from rlspmd.distributed.dispatch import all_gather_objects
from rlspmd.distributed.mesh import DP, TP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.engines.base import compute_dtype
from rlspmd.models.loader import eos_token_ids, load_tokenizer
from rlspmd.protocol import Batch
from rlspmd.metrics import MetricBuffer
from rlspmd.roles.policy import compute_logprobs
from rlspmd.trainer.build_models import actor_plan, build_policy
from rlspmd.trainer.build_rollout import build_rollout
from third_party.vllm_adapter import VllmBackend, prepare_environment

GiB = 2**30


def gap(policy, out) -> float:
    """Mean |rollout log-prob - trainer log-prob| on the sampled tokens (the rollout/logprob_gap metric)."""
    lp, _ = compute_logprobs(policy.engine.module, out, micro_batch_size=64, temperature=1.0)
    mask = out["response_mask_BR"].float()
    return float(((out["rollout_logprobs_BR"] - lp).abs() * mask).sum() / mask.sum())


@spmd_main
def main():
    model_dir = sys.argv[1]
    tp = int(sys.argv[sys.argv.index("--tp") + 1]) if "--tp" in sys.argv else 1
    lora = LoraConfig(rank=4, alpha=8.0) if "--lora" in sys.argv else LoraConfig()
    prepare_environment()
    rt = init_distributed(DistConfig())
    meshes = RoleMeshes(ParallelDims.from_config(MeshConfig(rollout_tp=tp), rt.world_size), "cuda", rt.rank)
    tok = load_tokenizer(model_dir, field_name="model")
    actor_cfg = ActorConfig(model=ModelConfig(path=model_dir), mini_batch_size=rt.world_size, micro_batch_size=4, lora=lora)
    plan = actor_plan(actor_cfg, samples_per_prompt=1, train_batch_size=rt.world_size, dp=rt.world_size, max_response_length=32,
                      total_steps=1)
    policy = build_policy(actor_cfg, mesh=meshes.get("actor", DP), device=rt.device, plan=plan, temperature=1.0)
    torch.cuda.synchronize()
    used_before = VllmBackend.memory_in_use()
    cfg = RolloutConfig(engine=VllmConfig(gpu_memory_utilization=0.3, enforce_eager=False), n=1, max_response_length=32,
                        val_temperature=0.0)
    rollout = build_rollout(cfg, meshes=meshes, policy=policy, model_path=model_dir, compute=compute_dtype(actor_cfg.engine.param_dtype, rt.device),
                            eos_ids=eos_token_ids(model_dir, tok), pad_id=tok.pad_token_id, device=rt.device, seed=0, max_prompt_length=64)
    used_asleep0 = VllmBackend.memory_in_use()
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Calculate {a} + {b}."}], tokenize=False, add_generation_prompt=True)
             for a, b in [(1, 2), (37, 45), (90, 9), (5, 5)]]
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    prompts = Batch({"prompts_BP": enc["input_ids"], "prompt_mask_BP": enc["attention_mask"]}).to(rt.device)

    buffer = MetricBuffer()
    rollout.sync_weights(buffer)  # wake weights -> stream-load -> reset prefix cache
    metrics = buffer.reduce(mesh=None)
    rollout.engine.wake()
    torch.cuda.synchronize()
    used_awake = VllmBackend.memory_in_use()
    out = rollout.engine.generate(prompts, rollout.val_params, generator=None)
    rollout.engine.sleep()
    torch.cuda.synchronize()
    used_asleep = VllmBackend.memory_in_use()
    g0 = gap(policy, out)
    # greedy parity: the trainer's log-probs of vLLM's greedy tokens agree, and its argmax picks the same first token
    assert g0 < 0.05, f"rollout/logprob_gap {g0:.4f} after the first sync"
    freed = used_awake - used_asleep
    engine_bytes = used_awake - used_before
    assert freed >= 0.8 * engine_bytes, f"sleep freed {freed / GiB:.2f} GiB of the engine's {engine_bytes / GiB:.2f} GiB"

    # update effectiveness: perturb what the actor trains (with LoRA: the adapters only), sync, the rollout follows
    # (and generation changes)
    with torch.no_grad():
        for p in policy.engine.module.parameters():
            if p.requires_grad:
                p.to_local().add_(torch.randn_like(p.to_local()) * (0.5 if lora.enabled else 0.05))
    rollout.sync_weights(MetricBuffer())
    out2 = rollout.generate_validation(prompts, step=1)
    g1 = gap(policy, out2)
    assert g1 < 0.05, f"rollout/logprob_gap {g1:.4f} after an update: the engine did not take the new weights"
    a, b = out["responses_BR"], out2["responses_BR"]
    assert a.shape != b.shape or not torch.equal(a, b), "perturbed weights produced the same greedy tokens"

    # TP peers generate identical tokens
    if tp > 1:
        got = all_gather_objects(out2["responses_BR"].cpu(), mesh=meshes.get("rollout", TP))
        assert all(torch.equal(got[0], x) for x in got)

    # 20 cycles: no memory drift while asleep
    drift = []
    for step in range(20):
        rollout.sync_weights(MetricBuffer())
        rollout.generate(prompts, step=step)
        torch.cuda.synchronize()
        drift.append(VllmBackend.memory_in_use())
    assert max(drift) - min(drift) < 256 * 2**20, [d / GiB for d in drift]
    if rt.rank == 0:
        print(f"memory GiB: before engine {used_before / GiB:.2f}, built+asleep {used_asleep0 / GiB:.2f}, awake {used_awake / GiB:.2f}, "
              f"asleep {used_asleep / GiB:.2f}; gap {g0:.4f} -> {g1:.4f}; sync metrics {metrics}", flush=True)
        print("VLLM GPU OK", flush=True)
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
