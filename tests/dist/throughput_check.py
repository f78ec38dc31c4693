"""Throughput options leave the numbers unchanged (2 ranks, Gloo): for one fixed global batch, the gradient of every
optimiser step and the loss are the same with

  padded forwards | packed | packed + token-budget micro-batches | packed + DP balancing (+ token budget)
  | packed + activation checkpointing | packed + FSDP2 CPU offload,

and the old/ref log-probs are the same padded, packed, and with token budgets (including a rank that holds fewer
samples than the agreed micro-batch count, so it runs zero-weight fillers). ``ref.offload`` warns on CPU that it
does nothing and the reference still works. Learning rate 0, so every variant sees the same weights. Rank 0
compares and prints THROUGHPUT OK.

usage: throughput_check.py MODEL_DIR [VARIANT,...]   (variants only: run them and exit, for debugging a hang)
"""

import sys
import warnings

import torch

from rlspmd.config import ActorConfig, DistConfig, FSDPConfig, MeshConfig, ModelConfig, OptimConfig, RefConfig
from rlspmd.distributed.dispatch import all_gather_objects, balance_batch
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.protocol import Batch
from rlspmd.metrics import MetricBuffer
from rlspmd.roles.policy import compute_logprobs
from rlspmd.trainer.build_models import actor_plan, build_policy, build_reference

B, P, R, N_SAMPLES = 8, 6, 10, 4
# Rank 0's rows are long, rank 1's short, so balancing has to move samples.
RESPONSE_LENGTHS = [10, 9, 10, 8, 1, 2, 1, 3]


def global_batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(4321)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    for b in range(B):
        prompt_mask[b, : b % 3] = 0
    response_mask = (torch.arange(R)[None] < torch.tensor(RESPONSE_LENGTHS)[:, None]).long()
    responses = torch.randint(3, vocab, (B, R), generator=g) * response_mask
    attn = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "input_ids_BL": torch.cat([torch.randint(3, vocab, (B, P), generator=g) * prompt_mask, responses], 1),
            "attention_mask_BL": attn,
            "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses_BR": responses,
            "response_mask_BR": response_mask,
            "loss_mask_BR": response_mask,
            "old_logprobs_BR": -torch.rand(B, R, generator=g) * 3 - 2,
            "ref_logprobs_BR": -torch.rand(B, R, generator=g) * 3 - 2,
            "advantages_BR": torch.randn(B, R, generator=g) * response_mask,
            "sample_B": torch.arange(B),
        }
    )


VARIANTS = {
    "padded": dict(packing=False),
    "packed": dict(),
    "dynamic": dict(max_tokens=20),
    "balanced": dict(balance=True),
    "balanced_dynamic": dict(balance=True, max_tokens=20),
    "checkpointing": dict(gradient_checkpointing=True),
    "cpu_offload": dict(cpu_offload=True),
}


def run_update(model_dir, dp, rt, *, packing=True, max_tokens=None, balance=False, gradient_checkpointing=False, cpu_offload=False):
    cfg = ActorConfig(
        model=ModelConfig(path=model_dir, packing=packing, gradient_checkpointing=gradient_checkpointing),
        optim=OptimConfig(lr=0.0, grad_clip=0.0),
        engine=FSDPConfig(cpu_offload=cpu_offload),
        mini_batch_size=1,  # 2 optimiser steps of 4 samples each (2 per rank)
        micro_batch_size=1,
        max_tokens_per_micro_batch=max_tokens,
        loss_agg_mode="seq-mean-token-mean",
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coef=0.01,
    )
    plan = actor_plan(cfg, samples_per_prompt=N_SAMPLES, train_batch_size=2, dp=dp.size(), max_response_length=R, total_steps=1)
    policy = build_policy(cfg, mesh=dp, device=rt.device, plan=plan, temperature=0.9)
    full = global_batch(policy.engine.hf_model.config.vocab_size)
    n = B // dp.size()
    local = full.slice(rt.rank * n, (rt.rank + 1) * n)
    info = {}
    if balance:
        local, info = balance_batch(local, mesh=dp, chunk_rows=plan.local_mini_batch)
        info["samples"] = all_gather_objects(local["sample_B"].tolist(), mesh=dp)
    grads = []
    step = policy.engine.optimizer.step

    def capture(*a, **k):
        grads.append({name: p.grad.full_tensor().clone() for name, p in policy.engine.module.named_parameters()})
        return step(*a, **k)

    policy.engine.optimizer.step = capture
    metrics = MetricBuffer()
    policy.update(local, metrics)
    metrics = metrics.reduce(mesh=dp)
    return {"grads": grads, "metrics": metrics, "info": info, "policy": policy, "batch": full}


@spmd_main
def main():
    model_dir = sys.argv[1]
    rt = init_distributed(DistConfig())
    dp = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    assert dp.size() == 2
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
    runs = {name: run_update(model_dir, dp, rt, **VARIANTS[name]) for name in only}
    if len(sys.argv) > 2:
        print("VARIANTS RAN", flush=True)
        return shutdown()

    # Balancing moved samples (rank 0 held all the long ones) and kept each mini-batch's membership.
    info = runs["balanced"]["info"]
    assert info["balance/token_imbalance_after"] < info["balance/token_imbalance_before"], info
    by_step = [sorted(info["samples"][0][:2] + info["samples"][1][:2]), sorted(info["samples"][0][2:] + info["samples"][1][2:])]
    assert by_step == [[0, 1, 4, 5], [2, 3, 6, 7]], by_step
    assert sorted(info["samples"][0]) != [0, 1, 2, 3], "nothing moved"

    # Log-prob passes: padded vs packed vs token budget, with rank 1 holding a single sample (fillers).
    packed_policy, padded_policy = runs["packed"]["policy"], runs["padded"]["policy"]
    full = runs["packed"]["batch"]
    local = full.slice(0, 7) if rt.rank == 0 else full.slice(7, 8)
    ref_lp = compute_logprobs(padded_policy.engine.module, local, micro_batch_size=4, temperature=0.7, with_entropy=True, mesh=dp)
    for max_tokens in (None, 12, 10_000):
        lp = compute_logprobs(packed_policy.engine.module, local, micro_batch_size=3, temperature=0.7, with_entropy=True,
                              max_tokens=max_tokens, mesh=dp)
        m = local["response_mask_BR"].bool()
        for a, b in zip(lp, ref_lp):
            torch.testing.assert_close(a[m], b[m], rtol=1e-5, atol=1e-5)
            assert bool((a[~m] == 0).all())

    # ref.offload on CPU: warns that it does nothing, and the reference still works.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = build_reference(RefConfig(offload=True), actor=ActorConfig(model=ModelConfig(path=model_dir)), mesh=dp,
                              device=rt.device, temperature=0.7)
    assert any("ref.offload does nothing" in str(w.message) for w in caught) and not ref.offload
    torch.testing.assert_close(ref.log_prob(local, MetricBuffer())["ref_logprobs_BR"], ref_lp[0] * local["response_mask_BR"], rtol=1e-5, atol=1e-5)

    if rt.rank == 0:
        base = runs["padded"]
        assert len(base["grads"]) == 2 and any(g.abs().sum() > 0 for g in base["grads"][0].values())
        for name, run in runs.items():
            assert abs(run["metrics"]["actor/pg_loss"] - base["metrics"]["actor/pg_loss"]) < 1e-5, name
            assert abs(run["metrics"]["actor/kl_loss"] - base["metrics"]["actor/kl_loss"]) < 1e-5, name
            for s, (g_run, g_base) in enumerate(zip(run["grads"], base["grads"])):
                for k, g in g_base.items():
                    torch.testing.assert_close(g_run[k], g, rtol=1e-4, atol=1e-6, msg=lambda msg: f"{name} step {s} {k}: {msg}")
        print("THROUGHPUT OK", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
