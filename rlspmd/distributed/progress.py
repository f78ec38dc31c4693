"""Hangs are named: every rank says where it is, rank 0 says who is late, and past a limit it ends the job.

Every rank keeps a ``Progress`` (the module-level ``progress``): the innermost stage it is in (``gen``, ``reward``,
``validate``, ...), the step, and since when. The trainer's ``StageProbe`` enters and leaves stages; outside any
stage a rank is *idle* (between steps, a rollout worker waiting for work) and is never blamed. A ``HangMonitor``
thread per rank publishes that view to the job's c10d store (the TCPStore torchrun provides) every ``interval``
seconds; on rank 0 it also reads every rank's view and

* warns, naming the rank, stage, step and seconds, when a rank has been in one stage longer than
  ``dist.hang_warn_s``, and repeats the warning every ``dist.hang_warn_s`` while that lasts;
* past ``dist.hang_timeout_s`` ends the job: it writes the message to the store, where every rank's monitor finds it
  within ``interval`` and exits non-zero, then exits itself.

The rank to blame is the busy one that is behind. Every rank runs the same program, so every rank makes the same
stage transitions in the same order; each counts its transitions since its current top-level stage (``step``,
``validate``, ...) began, and the rank with the fewest is behind: its peers have moved on and wait for it in a
collective. Ties (ranks at the same point) go to the rank longest in its stage. Counting, not clocks, is what tells
a late rank in ``reward`` from a peer that scored its own samples in a millisecond and now waits: both have been in
their stages for the same time, give or take the reporting interval. Only the trainer's stages count (the step's
``StageProbe``, validation, checkpoints); a rank ``waiting`` for peers with no work of its own is idle and never
blamed.

Durations are measured on each rank's own monotonic clock (no clock sync across nodes needed). A rank whose view
stops changing (its process holds the interpreter lock in C code, or is stopped) is counted as still in its stage
for the time rank 0 has not heard from it, and the message says so.

Simplifications: one store write per rank per ``interval`` and one batched read by rank 0 (fine for thousands of
ranks at the default interval of 5 s); a job whose store dies has lost its launcher, which ``parent.py`` handles.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


class Progress:
    """This rank's innermost stage, step and entry time. Written by the main thread, read by the monitor thread (one
    tuple, replaced atomically)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._stack: list[tuple[str, int | None]] = []  # (stage, step) from the outermost in
        self._now: tuple[int | None, str | None, float] = (None, None, clock())
        self.moves = 0  # transitions since the current top-level stage began (see the module docstring)

    def enter(self, stage: str, *, step: int | None = None) -> None:
        """Enter ``stage`` of ``step`` (None: the enclosing stage's step, if any; never a step left over from an
        earlier stage, which would name the wrong one)."""
        if step is None and self._stack:
            step = self._stack[-1][1]
        self.moves = self.moves + 1 if self._stack else 1
        self._stack.append((stage, step))
        self._now = (step, stage, self.clock())

    def exit(self) -> None:
        """Back to the enclosing stage (its clock restarts: the rank made progress), or idle."""
        self._pop()
        self.moves += 1

    def _pop(self) -> None:
        self._stack.pop()
        stage, step = self._stack[-1] if self._stack else (None, None)
        self._now = (step, stage, self.clock())

    @contextmanager
    def stage(self, name: str, *, step: int | None = None):
        self.enter(name, step=step)
        try:
            yield
        finally:
            self.exit()

    @contextmanager
    def waiting(self):
        """Waiting on peers with no work of this rank's own (a rollout-only rank while the actor's ranks train): shown
        as idle, so the monitor never blames the rank that waits for the one that is late."""
        self._stack.append((None, None))
        self._now = (None, None, self.clock())
        try:
            yield
        finally:
            self._pop()  # not a transition of the program every rank runs: a rank waits here and others do not

    def view(self) -> tuple[int | None, str | None, float]:
        """(step, stage or None when idle, seconds in it)."""
        step, stage, since = self._now
        return step, stage, self.clock() - since


progress = Progress()


@dataclass
class RankView:
    """What rank 0 knows of one rank: its last report and how long ago that report last changed."""

    rank: int
    step: int | None
    stage: str | None  # None: idle
    seconds: float  # in the stage, as the rank reported it plus the time since rank 0 last heard from it
    silent_s: float  # time since the rank's report last changed (a live rank reports every interval)
    moves: int = 0  # stage transitions since its top-level stage began: the fewest is behind


def blame(views: list[RankView]) -> RankView | None:
    """The rank that holds the job up: the busy rank that is behind (fewest transitions), then the longest in its
    stage (None when every rank is idle)."""
    busy = [v for v in views if v.stage is not None]
    return min(busy, key=lambda v: (v.moves, -v.seconds, v.rank)) if busy else None


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def where(views: list[RankView], *, interval: float) -> str:
    """Every rank's stage, ranks in the same stage and step grouped: ``rank 1 in 'reward' of step 3 for 62 s;
    ranks 0,2-7 in 'ref' of step 3 for up to 58 s``."""
    groups: dict[tuple, list[RankView]] = {}
    for v in sorted(views, key=lambda v: v.rank):
        groups.setdefault((v.stage, v.step), []).append(v)
    parts = []
    # Busy ranks first, longest in their stage first; idle ranks last.
    for (stage, step), vs in sorted(groups.items(), key=lambda kv: (kv[0][0] is None, -max(v.seconds for v in kv[1]))):
        who = f"rank {vs[0].rank}" if len(vs) == 1 else f"ranks {_ranges([v.rank for v in vs])}"
        if stage is None:
            parts.append(f"{who} idle")
            continue
        of_step = f" of step {step}" if step is not None else ""
        longest = max(v.seconds for v in vs)
        text = f"{who} in {stage!r}{of_step} for {'up to ' if len(vs) > 1 else ''}{longest:.0f} s"
        silent = [v for v in vs if v.silent_s > 3 * interval]
        if silent:
            text += f" (no report from {_ranges([v.rank for v in silent])} for {max(v.silent_s for v in silent):.0f} s)"
        parts.append(text)
    return "; ".join(parts)


class HangMonitor:
    """One per rank (``start``): publishes this rank's ``Progress`` to ``store``; leaves when the job is ended; on rank
    0, judges every rank's view (``check``). Every store call is made from this thread."""

    def __init__(
        self,
        store,
        *,
        rank: int,
        world_size: int,
        warn_s: float,
        timeout_s: float,
        prefix: str,
        end_job: Callable[[str], None],
        state: Progress = progress,
    ):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.warn_s, self.timeout_s = warn_s, timeout_s
        limits = [x for x in (warn_s, timeout_s) if x > 0]
        self.interval = min(5.0, max(0.5, min(limits) / 10)) if limits else 5.0
        self.prefix, self.end_job, self.state = prefix, end_job, state
        self.beat = 0
        self.heard: dict[int, tuple[int, float]] = {}  # rank -> (last beat seen, when it changed), rank 0 only
        self.last_views: list[RankView] = []
        self.warned: tuple | None = None  # (rank, stage, step, when) of the last warning
        self._store_error_reported = False

    def key(self, rank: int) -> str:
        return f"{self.prefix}/progress/{rank}"

    @property
    def abort_key(self) -> str:
        return f"{self.prefix}/abort"

    def start(self) -> "HangMonitor":
        threading.Thread(target=self._run, daemon=True, name="rlspmd-hang-monitor").start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the store is gone (launcher died) or unreachable: keep trying
                if not self._store_error_reported:
                    self._store_error_reported = True
                    sys.stderr.write(
                        f"[rlspmd] rank {self.rank}: hang monitor cannot reach the job's store: "
                        f"{type(e).__name__}: {e}\n"
                    )
                    sys.stderr.flush()
            time.sleep(self.interval)

    def publish(self) -> None:
        moves = self.state.moves  # read first: a transition in between makes it one low, never a view ahead of it
        step, stage, seconds = self.state.view()
        self.beat += 1
        self.store.set(
            self.key(self.rank),
            json.dumps({"step": step, "stage": stage, "seconds": seconds, "moves": moves, "beat": self.beat}),
        )

    def tick(self, now: float | None = None) -> None:
        self.publish()
        if self.rank != 0:
            if self.store.check([self.abort_key]):
                reason = self.store.get(self.abort_key).decode().splitlines()[0]
                self.end_job(f"[rlspmd] rank {self.rank}: the hang monitor on rank 0 ended the job: {reason}")
            return
        now = time.monotonic() if now is None else now
        self.check(self.read_views(now), now)

    def read_views(self, now: float) -> list[RankView]:
        """Every rank's last report (ranks that have not reported yet are left out)."""
        ranks = [r for r in range(self.world_size) if r in self.heard or self.store.check([self.key(r)])]
        views = []
        for r, raw in zip(ranks, self.store.multi_get([self.key(r) for r in ranks]) if ranks else []):
            report = json.loads(raw)
            beat, changed = self.heard.get(r, (None, now))
            if report["beat"] != beat:
                beat, changed = report["beat"], now
            self.heard[r] = (beat, changed)
            views.append(
                RankView(
                    r,
                    report["step"],
                    report["stage"],
                    report["seconds"] + (now - changed),
                    now - changed,
                    report["moves"],
                )
            )
        self.last_views = views
        return views

    def check(self, views: list[RankView], now: float | None = None) -> str | None:
        """Warn about, or end the job for, the rank that holds it up. Returns the message written, if any."""
        now = time.monotonic() if now is None else now
        late = blame(views)
        if late is None:
            return None
        of_step = f" of step {late.step}" if late.step is not None else ""
        head = f"rank {late.rank} has been in stage {late.stage!r}{of_step} for {late.seconds:.0f} s"
        if self.timeout_s > 0 and late.seconds >= self.timeout_s:
            message = (
                f"[rlspmd] hang: {head}, longer than dist.hang_timeout_s={self.timeout_s:g}; ending the job on every "
                f"rank. Where the ranks are: {where(views, interval=self.interval)}"
            )
            self.store.set(self.abort_key, message.removeprefix("[rlspmd] "))
            self.end_job(message)
            return message
        if self.warn_s <= 0 or late.seconds < self.warn_s:
            return None
        same = self.warned is not None and self.warned[:3] == (late.rank, late.stage, late.step)
        if same and now - self.warned[3] < self.warn_s:
            return None
        self.warned = (late.rank, late.stage, late.step, now)
        limit = f"; the job ends after dist.hang_timeout_s={self.timeout_s:g}" if self.timeout_s > 0 else ""
        message = (
            f"[rlspmd] hang monitor: {head} (dist.hang_warn_s={self.warn_s:g}{limit}). "
            f"Where the ranks are: {where(views, interval=self.interval)}"
        )
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        return message


def job_prefix() -> str:
    """Store keys of this job attempt: a torchrun restart starts with clean keys (the agent's store outlives it)."""
    return f"rlspmd/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
