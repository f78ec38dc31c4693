"""Algorithm stages across DP ranks.

1. Token rewards with an adaptive in-reward KL controller, then every advantage estimator, on each rank's share
   (whole groups) of one fixed global batch; the advantages are gathered on rank 0 and saved, so a test can
   compare world sizes (global whitening and GPG's alpha must not depend on the number of ranks).
2. Dynamic sampling with a scripted round function: after collection every rank holds the same number of whole
   groups, all distinct, all with signal when enough were found, topped up otherwise; prints SAMPLING OK.

usage: algorithm_check.py OUT.pt
"""

import dataclasses
import sys

import torch

from rlspmd.algorithms import ADVANTAGE_ESTIMATORS
from rlspmd.config import AdaptiveKL, AlgorithmConfig, DistConfig, FilterGroupsConfig, MeshConfig
from rlspmd.distributed.dispatch import all_gather_objects, gather_batch
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.trainer.advantage import AdvantageStage, build_token_rewards
from rlspmd.trainer.sampling import DynamicSampling

G, N, R = 4, 4, 6  # groups, samples per group, response length


def global_batch() -> Batch:
    g = torch.Generator().manual_seed(7)
    B = G * N
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R)[None] < lengths[:, None]).long()
    mask[1, 0] = 0 if lengths[1] > 1 else 1  # a hole
    scores = torch.randint(0, 2, (B,), generator=g).float()
    scores[0:N] = 1.0  # one all-equal group
    return Batch({
        "scores_B": scores,
        "response_mask_BR": mask,
        "loss_mask_BR": mask,
        "uid_B": torch.arange(G).repeat_interleave(N),
        "old_logprobs_BR": -torch.rand(B, R, generator=g) * mask,
        "ref_logprobs_BR": -torch.rand(B, R, generator=g) * mask,
        "sum_pi_squared_BR": torch.rand(B, R, generator=g) * mask,  # the optimal token baseline's
        "values_BR": torch.randn(B, R, generator=g) * mask,
        "baseline_scores_B": torch.rand(B, generator=g),
        "reward_components_BK": torch.stack([scores, torch.randint(0, 3, (B,), generator=g).float()], -1),  # gdpo
    })


def fake_round(rank: int, world: int, round_index: int, prompts_per_rank: int):
    """A scored round on this rank: the group's score pattern depends on (round, global prompt), widths vary."""
    P, Rr = 3 + (rank + round_index) % 2, 2 + round_index
    rows = prompts_per_rank * N
    first_prompt = rank * prompts_per_rank
    uid = (torch.arange(prompts_per_rank) + first_prompt).repeat_interleave(N)
    signal = (uid + round_index) % 3 == 0  # about a third of the groups carry signal
    task = torch.where(signal, (torch.arange(rows) % 2).float(), torch.ones(rows))
    prompt_mask = torch.ones(rows, P, dtype=torch.long)
    resp_mask = torch.ones(rows, Rr, dtype=torch.long)
    attn = torch.cat([prompt_mask, resp_mask], 1)
    prompts = torch.full((rows, P), 5)
    responses = (uid[:, None] * 10 + round_index).expand(rows, Rr).clone()  # tokens identify (prompt, round)
    return Batch(
        {"prompts_BP": prompts, "prompt_mask_BP": prompt_mask, "responses_BR": responses, "response_mask_BR": resp_mask,
         "loss_mask_BR": resp_mask,
         "input_ids_BL": torch.cat([prompts, responses], 1), "attention_mask_BL": attn,
         "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0), "uid_B": uid, "task_scores_B": task, "scores_B": task.clone()},
        {"tag": [f"p{int(u)}r{round_index}" for u in uid]},
    )


def check_dynamic_sampling(dp, rank: int, world: int, *, target: int, gen: int, max_rounds: int):
    sampling = DynamicSampling(FilterGroupsConfig(enable=True, max_rounds=max_rounds, gen_batch_size=gen), mesh=dp,
                               train_batch_size=target, samples_per_prompt=N, pad_id=0)
    metrics = MetricBuffer()
    batch = sampling.collect(lambda r: fake_round(rank, world, r, gen // world), metrics)
    m = metrics.reduce(mesh=dp)
    assert len(batch) == target // world * N, (len(batch), target, world)
    uid = batch["uid_B"]
    for i in range(0, len(batch), N):  # whole groups, contiguous, one (prompt, round) each
        assert (uid[i:i + N] == uid[i]).all(), uid
        assert len(set(batch["tag"][i:i + N])) == 1, batch["tag"][i:i + N]
        assert (batch["responses_BR"][i:i + N, 0] == batch["responses_BR"][i, 0]).all()
    torch.testing.assert_close(batch["position_ids_BL"], (batch["attention_mask_BL"].cumsum(-1) - 1).clamp(min=0))
    all_uids = sum(all_gather_objects(uid[::N].tolist(), mesh=dp), [])
    assert len(set(all_uids)) == len(all_uids) == target, all_uids
    with_signal = sum(all_gather_objects(int((batch["task_scores_B"].view(-1, N).std(-1) > 0).sum()), mesh=dp))
    return m, with_signal


@spmd_main
def main():
    out = sys.argv[1]
    rt = init_distributed(DistConfig())
    dp = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    w, r = rt.world_size, rt.rank
    full = global_batch()
    rows = len(full) // w
    results = {}
    for name in sorted(ADVANTAGE_ESTIMATORS.shipped()):
        component = ADVANTAGE_ESTIMATORS[name]
        options = {"gamma": 0.95, "lam": 0.9}
        estimator = component(**{f.name: options[f.name] for f in dataclasses.fields(component) if f.name in options})
        cfg = AlgorithmConfig(adv_estimator=estimator, use_kl_in_reward=True, kl_penalty="k3",
                              kl_ctrl=AdaptiveKL(kl_coef=0.05, target_kl=0.01, horizon=32))
        token_rewards = build_token_rewards(cfg, mesh=dp)
        local = full.slice(r * rows, (r + 1) * rows)
        local = token_rewards(local, MetricBuffer())
        local = AdvantageStage(cfg.adv_estimator, mesh=dp)(local, MetricBuffer())
        gathered = gather_batch(Batch({"adv": local["advantages_BR"], "ret": local["returns_BR"]}), mesh=dp)
        if r == 0:
            results[name] = {"adv": gathered["adv"], "ret": gathered["ret"], "kl_coef": token_rewards.controller.value}

    # enough signal after a few rounds: only groups with signal, balanced
    m, with_signal = check_dynamic_sampling(dp, r, w, target=4, gen=8, max_rounds=5)
    assert with_signal == 4 and m["sampling/groups_topped_up"] == 0, (with_signal, m)
    assert m["sampling/prompts_drawn"] == 8 * m["sampling/rounds"]
    # not enough within max_rounds=1: topped up with dropped groups to a full batch
    m, with_signal = check_dynamic_sampling(dp, r, w, target=8, gen=8, max_rounds=1)
    assert m["sampling/rounds"] == 1 and m["sampling/groups_topped_up"] == 8 - m["sampling/groups_with_signal"] > 0, m
    if r == 0:
        torch.save(results, out)
        print("SAMPLING OK", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
