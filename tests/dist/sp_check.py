"""Sequence parallel (``mesh.actor_sp``) against no sequence parallelism on the same ranks and data (CPU, Gloo).

usage: sp_check.py OUT.pt MODEL_DIR CASE[,CASE...] [--steps N] [--response-len R] [--actor-agg M] [--critic-agg M]

Each CASE is ``sp<degree>[-<mode>][-tp<degree>][-lora]`` (``sp1``, ``sp2``, ``sp4-allgather``, ``sp2-tp2``,
``sp2-lora``); all cases run in this one process, one after the other, on every rank's own rows of the same global
batch (one prompt's GRPO group of 2 samples per rank), as the trainer dispatches them. Per case and step the roles
run as a step does: the reference's and the actor's log-probs, the critic's values, GRPO advantages for the actor and
GAE returns for the critic, then the critic's and the actor's updates (the actor two PPO epochs with a k3 KL loss and
an entropy bonus, the critic with token-budget micro-batches; their loss aggregations from the options). The reduced
metrics (losses, gradient norms, KL, entropy, ...) and the reference log-probs, old log-probs and values (all rows,
gathered) are saved on rank 0.
"""

import argparse
import re

import torch
import torch.distributed as dist

from rlspmd.algorithms.advantages import gae, grpo_outcome, token_level_scores
from rlspmd.config import ActorConfig, CriticConfig, DistConfig, LoraConfig, MeshConfig, ModelConfig, OptimConfig
from rlspmd.config import RefConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.trainer.build_models import actor_plan, build_critic, build_policy, build_reference, critic_plan

N = 2  # samples per prompt: one GRPO group per rank
P = 24
TEMPERATURE = 0.9


def global_batch(vocab: int, *, rows: int, response_len: int, step: int) -> Batch:
    """``rows`` samples: left-padded prompts, responses of uneven lengths up to ``response_len`` (the longest of each
    rank's pair reaches it), a hole in one response's loss mask, a score per sample."""
    g = torch.Generator().manual_seed(100 + step)
    R = response_len
    lengths = [R - (i * 131) % (R // 2) if i % 2 == 0 else R // 3 + (i * 37) % (R // 2) for i in range(rows)]
    lengths = torch.tensor(lengths)
    prompt_mask = torch.ones(rows, P, dtype=torch.long)
    for b in range(rows):
        prompt_mask[b, : (b * 5) % 9] = 0
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    loss_mask = response_mask.clone()
    loss_mask[1, 5:40] = 0  # tool tokens: in the sequence, out of the loss
    prompts = torch.randint(3, vocab, (rows, P), generator=g) * prompt_mask
    responses = torch.randint(3, vocab, (rows, R), generator=g) * response_mask
    attn = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "input_ids_BL": torch.cat([prompts, responses], 1),
            "attention_mask_BL": attn,
            "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses_BR": responses,
            "response_mask_BR": response_mask,
            "loss_mask_BR": loss_mask,
            "rollout_logprobs_BR": -torch.rand(rows, R, generator=g) * 3 * response_mask,
            "scores_B": torch.rand(rows, generator=g),
            "uid_B": torch.arange(rows) // N,
        }
    )


def parse_case(case: str) -> dict:
    m = re.fullmatch(r"sp(\d+)(?:-(ulysses|allgather))?(?:-tp(\d+))?(-lora)?", case)
    assert m, f"bad case {case!r}"
    return dict(sp=int(m[1]), mode=m[2] or "auto", tp=int(m[3] or 1), lora=bool(m[4]))


def gather_rows(x: torch.Tensor, mesh) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(mesh.size())]
    dist.all_gather(parts, x.contiguous(), group=mesh.get_group())
    return torch.cat(parts)


def run_case(
    model_dir: str, rt, *, sp, mode, tp, lora, steps: int, response_len: int, actor_agg: str, critic_agg: str
) -> dict:
    meshes = RoleMeshes(
        ParallelDims.from_config(MeshConfig(actor_sp=sp, actor_sp_mode=mode, actor_tp=tp), rt.world_size),
        "cpu",
        rt.rank,
    )
    mesh = meshes.get("actor", DP)
    seq = dict(sequence_mesh=meshes.sequence_mesh("actor"), sequence_mode=mode, train_mesh=meshes.train_mesh("actor"))
    rows_per_rank, world = N, rt.world_size
    prompts = rows_per_rank * world // N
    model = ModelConfig(path=model_dir, gradient_checkpointing=True)
    # eps 1e-4: AdamW's first step divides by |g|; see tp_check.py
    optim = OptimConfig(lr=2e-3, eps=1e-4, grad_clip=0.1, warmup_steps=0)
    actor = ActorConfig(
        model=model,
        optim=optim,
        ppo_epochs=2,  # the second epoch's ratio is not 1: clipping, approx. KL
        mini_batch_size=prompts,
        micro_batch_size=1,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k3",
        entropy_coef=0.01,
        loss_agg_mode=actor_agg,
        logprob_micro_batch_size=2,
        lora=LoraConfig(rank=8 if lora else 0, alpha=16),
    )
    common = dict(
        samples_per_prompt=N, train_batch_size=prompts, dp=world, max_response_length=response_len, total_steps=steps
    )
    a_plan = actor_plan(actor, **common)
    policy = build_policy(actor, mesh=mesh, device=rt.device, plan=a_plan, temperature=TEMPERATURE, seed=3, **seq)
    ref = build_reference(
        RefConfig(logprob_micro_batch_size=1),
        actor=actor,
        mesh=mesh,
        device=rt.device,
        temperature=TEMPERATURE,
        policy=policy,
        **seq,
    )
    critic_cfg = CriticConfig(
        optim=OptimConfig(lr=1e-3, eps=1e-4, grad_clip=0.02),
        mini_batch_size=prompts,
        max_tokens_per_micro_batch=response_len + P,
        loss_agg_mode=critic_agg,
        values_micro_batch_size=2,
        cliprange_value=0.2,
        gradient_checkpointing=True,
    )
    c_plan = critic_plan(critic_cfg, **common)
    critic = build_critic(critic_cfg, model=model, mesh=mesh, device=rt.device, plan=c_plan, seed=3, **seq)
    vocab = policy.engine.hf_model.config.vocab_size
    out = {"metrics": [], "ref_logprobs": [], "values": [], "old_logprobs": []}
    for step in range(steps):
        full = global_batch(vocab, rows=rows_per_rank * world, response_len=response_len, step=step)
        batch = full.slice(rt.rank * rows_per_rank, (rt.rank + 1) * rows_per_rank)
        metrics = MetricBuffer()
        batch = ref.log_prob(batch, metrics)
        batch = policy.old_log_prob(batch, metrics)
        batch = critic.values(batch, metrics)
        mask = batch["loss_mask_BR"].float()
        token_rewards = token_level_scores(batch["scores_B"], mask)
        adv, _ = grpo_outcome(batch["scores_B"], mask, batch["uid_B"])
        _, returns = gae(token_rewards, batch["values_BR"], mask, gamma=1.0, lam=0.95)
        batch = batch.set(advantages_BR=adv, returns_BR=returns)
        batch = critic.update(batch, metrics)
        batch = policy.update(batch, metrics)
        out["metrics"].append(metrics.reduce(mesh=mesh))
        for key, name in (
            ("ref_logprobs", "ref_logprobs_BR"),
            ("values", "values_BR"),
            ("old_logprobs", "old_logprobs_BR"),
        ):
            out[key].append(gather_rows(batch[name], mesh))
    out["sp_group"] = None if meshes.sequence_mesh("actor") is None else meshes.sequence_mesh("actor").mesh.tolist()
    out["mode"] = None if policy.engine.seq is None else policy.engine.seq.mode
    return out


@spmd_main
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("model_dir")
    parser.add_argument("cases")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--response-len", type=int, default=2048)
    parser.add_argument("--actor-agg", default="token-mean")
    parser.add_argument("--critic-agg", default="seq-mean-token-sum-norm")
    args = parser.parse_args()
    rt = init_distributed(DistConfig())
    results = {}
    for case in args.cases.split(","):
        results[case] = run_case(
            args.model_dir,
            rt,
            **parse_case(case),
            steps=args.steps,
            response_len=args.response_len,
            actor_agg=args.actor_agg,
            critic_agg=args.critic_agg,
        )
    if rt.rank == 0:
        torch.save(results, args.out)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()
