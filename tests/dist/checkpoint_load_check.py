"""Load an RL checkpoint's actor onto this world size (DCP reshards) and report what was restored.

Builds the policy as the trainer does, restores it through ``Checkpointer.load``, and writes on rank 0:
the full (unsharded) model and optimiser state, and the per-token log-probs of a fixed batch under the
training forward (``compute_logprobs``).

usage: checkpoint_load_check.py MODEL_DIR CHECKPOINT OUT.pt
"""

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from rlspmd.config import ActorConfig, CheckpointConfig, DistConfig, MeshConfig, ModelConfig, OptimConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.models.loader import load_tokenizer
from rlspmd.protocol import Batch
from rlspmd.roles.policy import compute_logprobs
from rlspmd.trainer.build_models import actor_plan, build_policy
from rlspmd.trainer.checkpoint import Checkpointer

TEXTS = ["Calculate 12 + 30.", "Calculate 7 - 3 + 45.", "Calculate 99 - 9."]


def fixed_batch(tok) -> Batch:
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in TEXTS]
    answers = ["12 + 30 = 42 #### 42<|im_end|>", "7 - 3 = 4, 4 + 45 = 49 #### 49<|im_end|>", "#### 90<|im_end|>"]
    p = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    tok.padding_side = "right"
    r = tok(answers, padding=True, return_tensors="pt", add_special_tokens=False)
    tok.padding_side = "left"
    attn = torch.cat([p["attention_mask"], r["attention_mask"]], 1)
    return Batch(
        {
            "input_ids_BL": torch.cat([p["input_ids"], r["input_ids"]], 1),
            "attention_mask_BL": attn,
            "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses_BR": r["input_ids"],
            "response_mask_BR": r["attention_mask"],
            "loss_mask_BR": r["attention_mask"],
        }
    )


@spmd_main
def main():
    model_dir, ckpt, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rt = init_distributed(DistConfig())
    dp = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    cfg = ActorConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-3), mini_batch_size=2, micro_batch_size=4)
    plan = actor_plan(cfg, samples_per_prompt=2, train_batch_size=4, dp=dp.size(), max_response_length=16, total_steps=4)
    policy = build_policy(cfg, mesh=dp, device=rt.device, plan=plan, temperature=1.0)
    ckpt_root = Checkpointer(CheckpointConfig(), output_dir=str(ckpt.parent.parent), rank=rt.rank, world_size=rt.world_size)
    engine = policy.engine
    ckpt_root.load(ckpt, {"actor": engine}, engines={"actor": engine.param_shapes()}, components=[])
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    batch = fixed_batch(load_tokenizer(model_dir, field_name="model"))
    logprobs, _ = compute_logprobs(engine.module, batch, micro_batch_size=8, temperature=1.0)
    if rt.rank == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "logprobs": logprobs, "batch": batch.tensors, "lr": engine.lr}, out)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
