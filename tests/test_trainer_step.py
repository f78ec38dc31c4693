"""``RLTrainer.step`` in-process, with small fake stages: the order the stages run in, the batch each one hands to
the next, the one metric reduction per step (a global mean, not a mean of means), the stage timings, and the critic
warm-up branch (the first ``critic.warmup_steps`` steps update only the critic).

Every other step test runs the real roles under torchrun; this one pins down the loop itself, in milliseconds.
"""

from __future__ import annotations

import torch

from rlspmd.distributed.runtime import Runtime, StopRequest
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.stages import StagePoints
from rlspmd.trackers import Trackers
from rlspmd.trainer.rl import RLTrainer
from rlspmd.trainer.roles import Roles
from rlspmd.trainer.sampling import SingleRound
from rlspmd.trainer.checkpoint import NoCheckpointing


class Calls(list):
    """The names of the stages in the order they ran, and a fake stage factory that records itself."""

    def stage(self, name: str, metric: tuple[float, float] | None = None):
        def run(batch: Batch, metrics: MetricBuffer) -> Batch:
            self.append(name)
            if metric is not None:
                metrics.mean("fake/loss", *metric)
            # Each stage adds a column; its value is how many columns the batch had when it arrived.
            return batch.set(**{f"{name.replace('.', '_')}_B": torch.full((len(batch),), float(len(batch.keys())))})

        return run


class Obj:
    """An object whose methods are given as keyword arguments."""

    def __init__(self, **methods):
        self.__dict__.update(methods)


def make_trainer(calls: Calls, *, warmup_steps: int = 0) -> tuple[RLTrainer, dict]:
    seen = {}

    def generate(prompts, *, step, round=0):
        calls.append("rollout.generate")
        return prompts.set(responses_BR=torch.ones(len(prompts), 3, dtype=torch.long))

    def report_step(batch, metrics, probe):
        calls.append("report.step")
        seen["batch"], seen["seconds"] = batch, dict(probe.seconds)
        return metrics.reduce(mesh=None)

    def prompts_next():
        calls.append("prompts.next")
        return Batch({"prompt_ids_BP": torch.arange(8).view(4, 2)})

    def baseline(prompts, batch, metrics):
        calls.append("baseline")
        return batch

    roles = Roles(
        prompts=Obj(next=prompts_next),
        rollout=Obj(generate=generate, sync_weights=lambda m: calls.append("rollout.sync_weights")),
        reward=Obj(score=calls.stage("reward.score")),
        shaping=calls.stage("shaping"),
        baseline=baseline,
        sampling=SingleRound(train_batch_size=4),
        ref=Obj(log_prob=calls.stage("ref.log_prob")),
        teacher=Obj(log_prob=calls.stage("teacher.log_prob")),
        actor=Obj(
            old_log_prob=calls.stage("actor.old_log_prob"), update=calls.stage("actor.update", metric=(3.0, 1.0))
        ),
        critic=Obj(
            values=calls.stage("critic.values"),
            update=calls.stage("critic.update", metric=(1.0, 3.0)),
            warmup_steps=warmup_steps,
        ),
        token_rewards=calls.stage("token_rewards"),
        advantage=calls.stage("advantage"),
        distill=calls.stage("distill"),
        correction=calls.stage("correction"),
        balance=calls.stage("balance"),
        report=Obj(sampled=lambda batch, m: calls.append("report.sampled"), step=report_step),
        samples=Obj(train=lambda batch, step: calls.append("samples.train")),
        checkpointing=NoCheckpointing(),
        data_stats={"train_prompts": 4, "train_dropped": 0, "train_empty_dropped": 0, "val_prompts": 0},
        resume_from=None,
        attn_kernel="sdpa",
        rollout_correction=None,
        stages=StagePoints(),
        trackers=Trackers(),
    )
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return RLTrainer(None, roles=roles, rt=rt, stop_request=StopRequest(), val_batch_size=4), seen


DATA_FLOW = [
    "prompts.next",
    "rollout.generate",
    "report.sampled",
    "reward.score",
    "shaping",
    "baseline",
    "ref.log_prob",
    "teacher.log_prob",
    "actor.old_log_prob",
    "critic.values",
    "token_rewards",
    "advantage",
    "distill",
    "correction",
    "balance",
    "critic.update",
    "actor.update",
    "rollout.sync_weights",
    "samples.train",
    "report.step",
]


def test_a_step_runs_the_stages_in_the_order_of_the_data_flow_and_hands_each_the_previous_batch():
    calls = Calls()
    trainer, seen = make_trainer(calls)
    metrics = trainer.step(1)
    assert calls == DATA_FLOW
    batch = seen["batch"]
    # prompt ids + responses, then one column per stage, each seeing every column added before it
    added = [
        n
        for n in DATA_FLOW
        if n
        not in (
            "prompts.next",
            "rollout.generate",
            "report.sampled",
            "baseline",
            "rollout.sync_weights",
            "samples.train",
            "report.step",
        )
    ]
    for i, name in enumerate(added):
        assert batch[f"{name.replace('.', '_')}_B"].tolist() == [2.0 + i] * 4, name
    # one reduction: the global mean of the two contributions (3 over 1 and 1 over 3), not the mean of their means
    assert metrics == {"fake/loss": 1.0}
    # every stage timed, and the whole step, which closes before the report reads the probe
    assert set(seen["seconds"]) == {
        "step",
        "gen",
        "reward",
        "baseline",
        "ref",
        "teacher",
        "old_log_prob",
        "values",
        "adv",
        "balance",
        "update_critic",
        "update_actor",
        "weight_sync",
    }


def test_critic_warmup_steps_update_only_the_critic():
    calls = Calls()
    trainer, _ = make_trainer(calls, warmup_steps=2)
    updates = []
    for step in (1, 2, 3):
        calls.clear()
        metrics = trainer.step(step)
        updates.append([c for c in calls if c.endswith(".update")])
        # the actor's loss contribution is missing during the warm-up: the critic's alone is the mean
        assert metrics == {"fake/loss": 1.0 / 3.0 if step <= 2 else 1.0}
    assert updates == [["critic.update"], ["critic.update"], ["critic.update", "actor.update"]]
