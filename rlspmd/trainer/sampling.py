"""What a step trains on: generation rounds, ReMax's greedy baseline, and DAPO's dynamic sampling.

``SingleRound`` runs one round (prompts -> samples -> scores) and trains on it. ``DynamicSampling`` (DAPO, Yu et
al. 2025, arXiv 2503.14476) drops groups whose scores are all equal (no signal for a group-relative advantage) and
runs more rounds until ``data.train_batch_size`` groups with signal are collected, or ``max_rounds`` is reached.

The SPMD protocol, per round: every DP rank generates and scores its shard and counts the groups it keeps; the
counts are all-gathered; rank 0 decides whether another round is needed and broadcasts the decision. At the end
rank 0 plans which groups are trained on (``plan_groups``, a pure function of the counts) and broadcasts the
plan; then whole groups move between ranks (one object all-gather of the surplus groups only) so that every rank
holds the same number of groups and a prompt's samples stay together on one rank. Simplification: the surplus
goes to every rank and each keeps its own part (one collective instead of point-to-point pairs); the surplus is a
small share of one step's samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.algorithms import zero_variance_rows
from rlspmd.config import FilterGroupsConfig
from rlspmd.distributed.dispatch import all_gather_objects, broadcast_object
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch

RoundFn = Callable[[int], Batch]
"""``round_fn(round_index)``: one generation round on this rank (prompts drawn, generated, scored), its metrics in
the step's buffer."""


class SingleRound:
    def __init__(self, *, train_batch_size: int):
        self.prompts_per_round = train_batch_size

    def collect(self, round_fn: RoundFn, metrics: MetricBuffer) -> Batch:
        return round_fn(0)


class GreedyBaseline:
    """ReMax: the score of one greedy response per prompt, as ``baseline_scores_B`` on each of its samples."""

    def __init__(self, *, rollout, score: Callable[[Batch, MetricBuffer], Batch], samples_per_prompt: int):
        """``score``: the training reward (reward role, then shaping) the samples got."""
        self.rollout, self.score, self.n = rollout, score, samples_per_prompt

    def __call__(self, prompts: Batch, batch: Batch, metrics: MetricBuffer) -> Batch:
        """``prompts``: the round's prompts, whose greedy responses are the baseline of ``batch``'s samples."""
        greedy = self.score(self.rollout.generate_greedy(prompts), metrics)
        return batch.set(baseline_scores_B=greedy["scores_B"].repeat_interleave(self.n))


class FollowGreedy:
    """ReMax on the rollout-only ranks of a split placement: serve the greedy generation;
    scoring is the actor side's."""

    def __init__(self, *, rollout):
        self.rollout = rollout

    def __call__(self, prompts: Batch, batch: Batch, metrics: MetricBuffer) -> Batch:
        self.rollout.generate_greedy(prompts)
        return batch


class NoBaseline:
    def __call__(self, prompts: Batch, batch: Batch, metrics: MetricBuffer) -> Batch:
        return batch


@dataclass
class GroupPlan:
    """Which groups each rank trains on, and where the surplus goes.

    Per rank ``k``: ``kept[k]`` groups from the front of its kept list (all rounds, in order) and ``topped_up[k]``
    from the front of its last round's dropped list are selected (in that order); the first ``stay[k]`` selected
    stay, and the rest go, in order, to the ranks in ``send[k]`` (a list of ``(dst, n_groups)``).
    """

    kept: list[int]
    topped_up: list[int]
    stay: list[int]
    send: list[list[tuple[int, int]]]


def plan_groups(kept_per_round: list[list[int]], dropped_last: list[int], *, target: int) -> GroupPlan:
    """Select ``target`` groups and balance them over ranks; a pure function of the per-rank group counts.

    Args:
        kept_per_round: ``[round][rank]`` number of groups with signal.
        dropped_last: ``[rank]`` number of groups dropped in the last round (candidates to top up a short batch).
        target: groups to train on (``data.train_batch_size``), a multiple of the number of ranks.

    Every round of a step samples from the same policy, so all groups with signal are equally good: the plan
    keeps groups where they are and moves only what balance requires. Each rank keeps up to ``target / dp`` of
    its own groups with signal (earliest rounds first); under-full ranks are filled from the surplus of the
    others in rank order; a surplus nobody needs is trimmed. If all groups with signal are too few, the batch is
    topped up with last-round dropped groups, the under-full rank's own first. Deterministic, so any rank could
    compute it; rank 0 does and broadcasts it.
    """
    dp = len(dropped_last)
    assert target % dp == 0, (target, dp)
    per_rank = target // dp
    totals = [sum(r[k] for r in kept_per_round) for k in range(dp)]
    kept = [min(c, per_rank) for c in totals]
    left = target - sum(kept)
    for k in range(dp):  # surplus groups with signal fill other ranks
        take = min(totals[k] - kept[k], left)
        kept[k] += take
        left -= take
    topped_up = [0] * dp
    for k in range(dp):  # a short batch is topped up with dropped groups: an under-full rank's own first
        topped_up[k] = min(dropped_last[k], max(0, per_rank - kept[k]), left)
        left -= topped_up[k]
    for k in range(dp):  # then other ranks' dropped groups
        take = min(dropped_last[k] - topped_up[k], left)
        topped_up[k] += take
        left -= take
    if left:
        raise ValueError(f"dynamic sampling found only {target - left} groups for a batch of {target}")
    selected = [a + b for a, b in zip(kept, topped_up)]
    stay = [min(s, per_rank) for s in selected]
    deficits = [[k, per_rank - s] for k, s in enumerate(stay) if s < per_rank]
    send: list[list[tuple[int, int]]] = [[] for _ in range(dp)]
    for k in range(dp):
        surplus = selected[k] - stay[k]
        while surplus:
            dst, need = deficits[0]
            moved = min(need, surplus)
            send[k].append((dst, moved))
            surplus -= moved
            deficits[0][1] -= moved
            if deficits[0][1] == 0:
                deficits.pop(0)
    return GroupPlan(kept=kept, topped_up=topped_up, stay=stay, send=send)


class DynamicSampling:
    def __init__(
        self, cfg: FilterGroupsConfig, *, mesh: DeviceMesh, train_batch_size: int, samples_per_prompt: int, pad_id: int
    ):
        gen = cfg.gen_batch_size or train_batch_size
        if gen < train_batch_size:
            raise ValueError(
                f"algorithm.filter_groups.gen_batch_size={gen} must be >= data.train_batch_size={train_batch_size}"
            )
        if gen % mesh.size():
            raise ValueError(f"algorithm.filter_groups.gen_batch_size={gen} does not split over {mesh.size()} DP ranks")
        if cfg.max_rounds < 1:
            raise ValueError(f"algorithm.filter_groups.max_rounds must be >= 1, got {cfg.max_rounds}")
        if samples_per_prompt < 2:
            raise ValueError("algorithm.filter_groups.enable needs rollout.n >= 2 (a single sample is never kept)")
        self.cfg, self.mesh = cfg, mesh
        self.prompts_per_round = gen
        self.target, self.n, self.pad_id = train_batch_size, samples_per_prompt, pad_id
        self.metric_key = {"task_score": "task_scores_B", "score": "scores_B"}[cfg.metric]

    def collect(self, round_fn: RoundFn, metrics: MetricBuffer) -> Batch:
        kept: list[Batch] = []
        kept_per_round: list[list[int]] = []
        for r in range(self.cfg.max_rounds):
            batch = round_fn(r)
            # Ids must stay unique when rounds are merged: shift each round's prompt ids past the previous ones'.
            batch.set(uid_B=batch["uid_B"] + r * self.prompts_per_round)
            metrics.mean("sampling/drawn_score_mean", batch["scores_B"].sum(), len(batch))
            metrics.mean("sampling/drawn_acc", (batch["task_scores_B"] >= 1.0).float().sum(), len(batch))
            degenerate = zero_variance_rows(batch[self.metric_key], batch["uid_B"]).cpu()
            kept.append(batch.select(torch.nonzero(~degenerate).squeeze(-1)))
            dropped = batch.select(torch.nonzero(degenerate).squeeze(-1))
            counts = all_gather_objects((len(kept[-1]) // self.n, len(dropped) // self.n), mesh=self.mesh)
            kept_per_round.append([c[0] for c in counts])
            found = sum(map(sum, kept_per_round))
            # Over the whole world: in split placement the rollout ranks follow the rounds (``FollowRounds``).
            done = broadcast_object(found >= self.target or r + 1 == self.cfg.max_rounds)
            if done:
                break
        dropped_last = [c[1] for c in counts]
        plan = broadcast_object(plan_groups(kept_per_round, dropped_last, target=self.target), mesh=self.mesh)
        batch = self._rebalance(kept, dropped, plan)
        metrics.max("sampling/rounds", len(kept_per_round))
        metrics.max("sampling/prompts_drawn", len(kept_per_round) * self.prompts_per_round)
        metrics.max("sampling/groups_with_signal", found)
        metrics.max("sampling/groups_topped_up", sum(plan.topped_up))
        metrics.max("sampling/groups_moved", sum(n for sends in plan.send for _, n in sends))
        return batch

    def _rebalance(self, kept: list[Batch], dropped: Batch, plan: GroupPlan) -> Batch:
        """This rank's selected groups, less those it sends, plus those it receives (whole groups only)."""
        me, n = self.mesh.get_local_rank(), self.n
        device = dropped["responses_BR"].device
        pieces = []
        if plan.kept[me]:
            pieces.append(Batch.concat_padded(kept, pad_id=self.pad_id).slice(0, n * plan.kept[me]))
        if plan.topped_up[me]:
            pieces.append(dropped.slice(0, n * plan.topped_up[me]))
        selected = Batch.concat_padded(pieces, pad_id=self.pad_id) if pieces else None
        outgoing, start = {}, n * plan.stay[me]
        for dst, groups in plan.send[me]:
            outgoing[dst] = selected.slice(start, start + n * groups).to("cpu")
            start += n * groups
        gathered = all_gather_objects(outgoing, mesh=self.mesh)
        staying = [selected.slice(0, n * plan.stay[me])] if plan.stay[me] else []
        incoming = [g[me].to(device) for g in gathered if me in g]
        return Batch.concat_padded(staying + incoming, pad_id=self.pad_id)


class FollowRounds:
    """Dynamic sampling on the rollout-only ranks of a split placement: serve each round's generation until rank 0
    broadcasts that the step has enough groups (the decision ``DynamicSampling`` takes on the actor's ranks)."""

    def __init__(self, cfg: FilterGroupsConfig):
        self.max_rounds = cfg.max_rounds

    def collect(self, round_fn: RoundFn, metrics: MetricBuffer) -> Batch:
        for r in range(self.max_rounds):
            batch = round_fn(r)
            if broadcast_object(None):
                break
        return batch
