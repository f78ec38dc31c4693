"""The critic's value-loss gradient of one update for a fixed global batch, gathered on rank 0 and saved.

Run with different world sizes / micro-batch sizes: the gradients must agree (global loss normalisation,
summed gradients). Learning rate 0 and no clipping, so the update leaves the gradients to inspect.

usage: critic_grad_check.py MODEL_DIR OUT.pt MICRO_BATCH MODE[,MODE...]
"""

import sys

import torch

from rlspmd.config import CriticConfig, DistConfig, MeshConfig, ModelConfig, OptimConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.protocol import Batch
from rlspmd.metrics import MetricBuffer
from rlspmd.trainer.build_models import build_critic, critic_plan

B, P, R, N_SAMPLES = 8, 6, 10, 4


def global_batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(4321)
    prompts = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    for b in range(B):
        prompt_mask[b, : b % 3] = 0
    lengths = torch.tensor([10, 3, 7, 1, 10, 5, 2, 8])
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    response_mask[0, 4:6] = 0  # a hole (tool tokens)
    responses = torch.randint(3, vocab, (B, R), generator=g) * response_mask
    attn = torch.cat([prompt_mask, (torch.arange(R)[None] < lengths[:, None]).long()], 1)
    return Batch(
        {
            "input_ids_BL": torch.cat([prompts * prompt_mask, responses], 1),
            "attention_mask_BL": attn,
            "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses_BR": responses,
            "response_mask_BR": response_mask,
            "loss_mask_BR": response_mask,
            "values_BR": torch.randn(B, R, generator=g) * 0.3 * response_mask,
            "returns_BR": torch.rand(B, R, generator=g) * response_mask,
        }
    )


@spmd_main
def main():
    model_dir, out, micro, modes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    rt = init_distributed(DistConfig())
    dp = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    results = {}
    for mode in modes:
        cfg = CriticConfig(
            optim=OptimConfig(lr=0.0, grad_clip=0.0), mini_batch_size=B // N_SAMPLES, micro_batch_size=micro,
            loss_agg_mode=mode, cliprange_value=0.2,
        )
        plan = critic_plan(cfg, samples_per_prompt=N_SAMPLES, train_batch_size=B // N_SAMPLES, dp=dp.size(), max_response_length=R,
                           total_steps=1)
        critic = build_critic(cfg, model=ModelConfig(path=model_dir), mesh=dp, device=rt.device, plan=plan, seed=0)
        full = global_batch(critic.engine.module.config.vocab_size)
        n = B // rt.world_size
        metrics = MetricBuffer()
        critic.update(full.slice(rt.rank * n, (rt.rank + 1) * n), metrics)
        metrics = metrics.reduce(mesh=dp)
        grads = {k: p.grad.full_tensor() for k, p in critic.engine.module.named_parameters()}
        results[mode] = {"grads": grads, "vf_loss": metrics["critic/vf_loss"], "vf_clip_frac": metrics["critic/vf_clip_frac"]}
    if rt.rank == 0:
        torch.save(results, out)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
