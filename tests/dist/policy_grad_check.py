"""The policy gradient of one update for a fixed global batch, gathered on rank 0 and saved.

Run with different world sizes / micro-batch sizes: the gradients must agree (global loss normalisation,
summed gradients). Learning rate 0 and no clipping, so the update leaves the gradients to inspect.

usage: policy_grad_check.py MODEL_DIR OUT.pt MICRO_BATCH MODE[,MODE...] [LOSS[,LOSS...]]

With a list of policy losses (default ppo_clip) the results are keyed ``"MODE/LOSS"``, except for ppo_clip alone.
"""

import sys

import torch

from rlspmd.algorithms import POLICY_LOSSES
from rlspmd.config import GSPO, SAPO, ActorConfig, DistConfig, MeshConfig, ModelConfig, OptimConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.protocol import Batch
from rlspmd.metrics import MetricBuffer
from rlspmd.trainer.build_models import actor_plan, build_policy

B, P, R, N_SAMPLES = 8, 6, 10, 4


def global_batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(1234)
    prompts = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    for b in range(B):
        prompt_mask[b, : b % 3] = 0
    lengths = torch.tensor([10, 3, 7, 1, 10, 5, 2, 8])
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    responses = torch.randint(3, vocab, (B, R), generator=g) * response_mask
    attn = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "input_ids_BL": torch.cat([prompts * prompt_mask, responses], 1),
            "attention_mask_BL": attn,
            "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses_BR": responses,
            "response_mask_BR": response_mask,
            "loss_mask_BR": response_mask,
            "old_logprobs_BR": -torch.rand(B, R, generator=g) * 3 - 2,
            "ref_logprobs_BR": -torch.rand(B, R, generator=g) * 3 - 2,
            "advantages_BR": torch.randn(B, R, generator=g) * response_mask,
        }
    )


# options other than the defaults: GSPO with PPO's clip range (its paper's 3e-4 would clip nothing here), SAPO with
# asymmetric temperatures
SPECIAL = {"gspo": GSPO(clip_ratio_low=0.2, clip_ratio_high=0.2), "sapo": SAPO(tau_pos=0.9)}


@spmd_main
def main():
    model_dir, out, micro, modes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    losses = sys.argv[5].split(",") if len(sys.argv) > 5 else ["ppo_clip"]
    rt = init_distributed(DistConfig())
    dp = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    results = {}
    for mode, loss in [(m, l) for m in modes for l in losses]:
        cfg = ActorConfig(
            model=ModelConfig(path=model_dir),
            optim=OptimConfig(lr=0.0, grad_clip=0.0),
            mini_batch_size=B // N_SAMPLES,
            micro_batch_size=micro,
            loss_agg_mode=mode,
            policy_loss=SPECIAL.get(loss) or POLICY_LOSSES[loss](),
            use_kl_loss=True,
            kl_loss_coef=0.1,
            entropy_coef=0.01,
        )
        plan = actor_plan(cfg, samples_per_prompt=N_SAMPLES, train_batch_size=B // N_SAMPLES, dp=dp.size(), max_response_length=R,
                          total_steps=1)
        policy = build_policy(cfg, mesh=dp, device=rt.device, plan=plan, temperature=0.9)
        full = global_batch(policy.engine.hf_model.config.vocab_size)
        n = B // rt.world_size
        metrics = MetricBuffer()
        policy.update(full.slice(rt.rank * n, (rt.rank + 1) * n), metrics)
        metrics = metrics.reduce(mesh=dp)
        grads = {k: p.grad.full_tensor() for k, p in policy.engine.module.named_parameters()}
        key = mode if losses == ["ppo_clip"] else f"{mode}/{loss}"
        results[key] = {"grads": grads, "pg_loss": metrics["actor/pg_loss"]}
    if rt.rank == 0:
        torch.save(results, out)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
