"""The hang monitor in one process: two ranks' monitors on one real c10d store, driven by a test clock. Who is
blamed, what the warning and the final message say, when they repeat, and how a silent rank is reported."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlspmd.distributed.progress import HangMonitor, Progress, RankView, blame, progress, where
from rlspmd.trainer.timing import StageProbe


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_stages_nest_and_each_transition_restarts_the_clock():
    clock = Clock()
    p = Progress(clock)
    assert p.view() == (None, None, 0.0)  # idle
    p.enter("step", step=3)
    clock.t += 5
    with p.stage("reward"):
        clock.t += 2
        assert p.view() == (3, "reward", 2.0)
    clock.t += 1
    assert p.view() == (3, "step", 1.0)  # back in the enclosing stage, clock restarted on leaving 'reward'
    p.exit()
    assert p.view()[:2] == (None, None)
    with p.stage("validate"):  # no step given and none enclosing: none is named (not step 3, long past)
        assert p.view()[:2] == (None, "validate")


def test_stage_probe_publishes_its_stages():
    t = StageProbe(torch.device("cpu"), step=4)
    with t("step"):
        with t("gen"):
            assert progress.view()[:2] == (4, "gen")
        assert progress.view()[:2] == (4, "step")
        with progress.waiting():  # a rank waiting on its peers shows idle
            assert progress.view()[1] is None
        assert progress.view()[:2] == (4, "step")
    assert progress.view()[1] is None and set(t.seconds) == {"step", "gen"}


def test_blame_and_where():
    views = [
        RankView(0, 3, "ref", 50.0, 1.0),
        RankView(1, 3, "reward", 62.0, 1.0),
        RankView(2, 3, "ref", 48.0, 1.0),
        RankView(3, 3, "ref", 49.0, 1.0),
        RankView(4, None, None, 500.0, 1.0),
    ]
    assert blame(views).rank == 1  # the idle rank 4 has waited longest, but is never blamed
    assert (
        where(views, interval=5)
        == "rank 1 in 'reward' of step 3 for 62 s; ranks 0,2-3 in 'ref' of step 3 for up to 50 s; rank 4 idle"
    )
    assert blame([RankView(0, None, None, 9.0, 0.0)]) is None


def monitors(clock: Clock, *, warn_s=60.0, timeout_s=600.0):
    store = dist.HashStore()
    ended: dict[int, list[str]] = {0: [], 1: []}
    states = {r: Progress(clock) for r in (0, 1)}
    ms = {
        r: HangMonitor(
            store,
            rank=r,
            world_size=2,
            warn_s=warn_s,
            timeout_s=timeout_s,
            prefix="test",
            end_job=ended[r].append,
            state=states[r],
        )
        for r in (0, 1)
    }
    return ms, states, ended


def test_warns_naming_rank_stage_step_and_seconds_repeats_then_ends_the_job(capsys):
    clock = Clock()
    ms, states, ended = monitors(clock)
    states[1].enter("reward", step=3)  # rank 1 starts scoring and never returns
    clock.t += 10
    states[0].enter("ref", step=3)  # rank 0 moves on and waits for rank 1 in the reference forward

    def tick(at: float) -> str:
        clock.t = at
        ms[1].tick()
        ms[0].tick(now=at)
        return capsys.readouterr().err

    assert tick(1059) == ""  # 59 s < dist.hang_warn_s
    first = tick(1060)
    assert first == (
        "[rlspmd] hang monitor: rank 1 has been in stage 'reward' of step 3 for 60 s (dist.hang_warn_s=60; the job "
        "ends after dist.hang_timeout_s=600). Where the ranks are: rank 1 in 'reward' of step 3 for 60 s; "
        "rank 0 in 'ref' of step 3 for 50 s\n"
    )
    assert tick(1100) == ""  # not again before another dist.hang_warn_s
    assert "rank 1 has been in stage 'reward' of step 3 for 120 s" in tick(1120)
    assert not ended[0] and not ended[1]
    tick(1600)
    assert ended[0] == [
        "[rlspmd] hang: rank 1 has been in stage 'reward' of step 3 for 600 s, longer than dist.hang_timeout_s=600; "
        "ending the job on every rank. Where the ranks are: rank 1 in 'reward' of step 3 for 600 s; rank 0 in 'ref' "
        "of step 3 for 590 s"
    ]
    ms[1].tick()  # every other rank finds the verdict in the store at its next tick
    assert ended[1] == [
        "[rlspmd] rank 1: the hang monitor on rank 0 ended the job: hang: rank 1 has been in stage 'reward' of "
        "step 3 for 600 s, longer than dist.hang_timeout_s=600; ending the job on every rank. Where the ranks are: "
        "rank 1 in 'reward' of step 3 for 600 s; rank 0 in 'ref' of step 3 for 590 s"
    ]


def test_a_rank_that_stops_reporting_is_counted_and_named(capsys):
    """A rank whose monitor thread cannot run (its process holds the interpreter lock in C code, or is stopped)
    stops reporting: rank 0 counts the silence as more time in its stage and says so."""
    clock = Clock()
    ms, states, ended = monitors(clock)
    states[1].enter("reward", step=2)
    clock.t = 1005
    states[0].enter("ref", step=2)
    clock.t = 1030
    ms[1].tick()  # rank 1's last report: 30 s in 'reward'
    ms[0].tick(now=1030)
    clock.t = 1100
    ms[0].tick(now=1100)
    err = capsys.readouterr().err
    assert (
        "rank 1 has been in stage 'reward' of step 2 for 100 s" in err and "rank 0 in 'ref' of step 2 for 95 s" in err
    )
    assert "rank 1 in 'reward' of step 2 for 100 s (no report from 1 for 70 s)" in err


def test_a_job_of_idle_ranks_is_never_ended():
    clock = Clock()
    ms, states, ended = monitors(clock, warn_s=1, timeout_s=2)
    clock.t += 1000
    ms[1].tick()
    ms[0].tick(now=clock.t)
    assert not ended[0] and not ended[1]


def test_the_rank_behind_is_blamed_not_the_one_that_waits_for_it():
    """Rank 0 scored its samples at once and waits in 'validate' for rank 1, still in 'reward': both have been in their
    stages for the same time, but rank 1 has made fewer transitions of the program both run, so it is behind."""
    ranks = [Progress(Clock()), Progress(Clock())]
    for p in ranks:
        p.enter("validate", step=0)
        p.enter("gen")
        p.exit()
        p.enter("reward")
    ranks[0].exit()  # rank 0 is done; rank 1 hangs in its reward function
    views = [RankView(r, *p.view(), 0.0, p.moves) for r, p in enumerate(ranks)]
    assert [v.seconds for v in views] == [0.0, 0.0] and blame(views).rank == 1
    with ranks[0].waiting():  # waiting is not a transition of the program: no rank moves ahead by waiting
        assert ranks[0].moves == 5
    assert ranks[0].moves == 5
    ranks[0].exit()
    ranks[0].enter("step", step=1)  # a new top-level stage starts the count again
    assert ranks[0].moves == 1
