"""A pool of reward worker processes with a hard per-call time limit.

Each worker is a fresh interpreter (``python -m rlspmd.rewards.worker``: spawned, never forked from a rank that
holds threads, process groups or CUDA) that imports the user's function once and then scores samples in chunks,
answering each call as it returns. The rank therefore knows which call each worker is in and since when; a call
that overruns ``timeout_s`` is stopped by SIGKILL of its worker, which cannot be ignored (a C-level loop in a
math checker ignores SIGALRM-style timeouts), and the worker is replaced while the others carry on. The samples
of a batch are spread over the workers in small chunks, so slow checkers use every core the rank has.

Simplification: the time limit is measured from when the rank hands a worker its chunk or reads the previous
answer, so it includes the pipe's latency (microseconds).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

# A worker's interpreter and the user's module must load within this (the time limit of a call starts after).
STARTUP_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    """What one call gave: ``ok`` (``value``), ``error`` (``error`` = "Type: message"), or ``timeout``."""

    kind: str
    value: object = None
    error: str = ""


class RewardWorkerError(RuntimeError):
    """A worker could not start, or died; ``item`` is the index of the item it was scoring, if any."""

    def __init__(self, message: str, item: int | None = None):
        super().__init__(message)
        self.item = item


@dataclass
class _Worker:
    proc: subprocess.Popen
    send: Connection
    recv: Connection
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    chunk: deque = field(default_factory=deque)  # slots of the current chunk not answered yet
    since: float = 0.0  # when the current call started

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()


class RewardPool:
    """``num_workers`` worker processes for ``spec`` (a ``reward.function``; None: the rules by data_source)."""

    def __init__(self, spec: str | None, *, num_workers: int, timeout_s: float, field_name: str = "reward.function"):
        if num_workers < 1:
            raise ValueError(f"reward.num_workers must give at least one worker, got {num_workers}")
        self.spec, self.timeout_s, self.field_name = spec, timeout_s, field_name
        self.workers: list[_Worker] = []
        self.workers.extend(self._spawn() for _ in range(num_workers))
        self.replaced = 0  # workers killed for overrunning the limit, since the pool started

    def _spawn(self) -> _Worker:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        args = [
            sys.executable,
            "-m",
            "rlspmd.rewards.worker",
            str(to_child_r),
            str(from_child_w),
            str(os.getpid()),
            self.spec or "",
        ]
        # A session of its own: the stop signals meant for the rank (torchrun's SIGTERM to the rank's process group,
        # SLURM's SIGUSR1, Ctrl-C) must not kill a worker mid-step; it ends with its rank (parent-death signal, end of
        # input) or by the rank's SIGKILL.
        proc = subprocess.Popen(
            args, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True
        )
        os.close(to_child_r)
        os.close(from_child_w)
        return _Worker(proc, Connection(to_child_w, readable=False), Connection(from_child_r, writable=False))

    def map(self, items: list[tuple]) -> list[Outcome]:
        """Score ``items`` (``(response, ground_truth, extra_info, data_source)`` each); one ``Outcome`` per item,
        in order. A call past ``timeout_s`` gives ``timeout`` (its worker is replaced); the rest carry on."""
        results: list[Outcome | None] = [None] * len(items)
        pending = deque(range(len(items)))
        chunk = max(1, math.ceil(len(items) / (4 * len(self.workers))))
        while pending or any(w.chunk for w in self.workers):
            now = time.monotonic()
            for w in self.workers:
                if w.ready and not w.chunk and pending:
                    slots = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                    try:
                        w.send.send([(s, *items[s]) for s in slots])
                    except OSError:  # it died between calls (killed from outside, out of memory)
                        raise RewardWorkerError(
                            f"a reward worker died (exit code {w.proc.wait()})", item=slots[0]
                        ) from None
                    w.chunk, w.since = deque(slots), now
            deadlines = [w.since + self.timeout_s for w in self.workers if w.chunk]
            deadlines += [w.started + STARTUP_TIMEOUT_S for w in self.workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            for conn in wait([w.recv for w in self.workers], timeout=wait_s):
                self._receive(next(w for w in self.workers if w.recv is conn), results)
            now = time.monotonic()
            for i, w in enumerate(self.workers):
                if w.chunk and now - w.since >= self.timeout_s:
                    slot = w.chunk.popleft()
                    results[slot] = Outcome("timeout")
                    pending.extendleft(reversed(w.chunk))  # the rest of its chunk goes to the others first
                    w.kill()
                    self.workers[i] = self._spawn()
                    self.replaced += 1
                elif not w.ready and now - w.started >= STARTUP_TIMEOUT_S:
                    raise RewardWorkerError(
                        f"{self.field_name}: a reward worker did not start within {STARTUP_TIMEOUT_S:.0f} s "
                        f"(importing {self.spec or 'the rules'})"
                    )
        return results

    def _receive(self, w: _Worker, results: list) -> None:
        while w.recv.poll():
            try:
                msg = w.recv.recv()
            except EOFError:
                code = w.proc.wait()
                raise RewardWorkerError(
                    f"a reward worker died (exit code {code})", item=w.chunk[0] if w.chunk else None
                ) from None
            if msg[0] == "ready":
                w.ready = True
            elif msg[0] == "failed":
                raise RewardWorkerError(f"{self.field_name}={self.spec!r}: the reward worker cannot load it: {msg[1]}")
            else:
                slot = w.chunk.popleft()
                assert slot == msg[1], (slot, msg[1])
                results[slot] = (
                    Outcome("ok", value=msg[2]) if msg[0] == "ok" else Outcome("error", error=f"{msg[2]}: {msg[3]}")
                )
                w.since = time.monotonic()

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __del__(self):  # a pool dropped without close() (tests, a discarded manager) takes its workers with it
        if self.workers:
            self.close()
