"""Honest stage timing on accelerators: synchronise before reading the clock, and peak memory per stage.

CUDA runs asynchronously: a stage's Python code returns as soon as its kernels are queued, so a wall clock read
right after it charges the stage's GPU time to whichever later stage first waits on the device. ``device_synchronize``
waits for the queued work first (a no-op on CPU). It is a host sync by design, so it belongs at stage boundaries
only (a handful per step), never inside one.

``StageProbe`` times named stages that way, records each stage's peak allocated device memory, and publishes the stage
(with the step) to this rank's ``Progress``, so the hang monitor can name the rank and stage that hold a job up
(``rlspmd/distributed/progress.py``). Stages may nest
(``step`` around ``gen``, ``ref``, ...): the allocator has one peak counter, so a probe resets it when a stage starts
and hands the peak it saw to the enclosing stage when it ends, which makes every stage's figure its own true peak.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rlspmd.distributed.progress import progress


def device_synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` has finished (CUDA); nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageProbe:
    """Seconds (device-synchronised) and peak device memory (bytes, CUDA only) of named, possibly nested stages.

    ``seconds`` and ``peak_bytes`` accumulate over repeated stages of the same name (sum and max).
    """

    def __init__(self, device: torch.device, *, step: int | None = None):
        self.device, self.step = device, step
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self._open: list[int] = []  # peak seen so far by each open stage (innermost last)

    @contextmanager
    def __call__(self, name: str):
        cuda = self.device.type == "cuda"
        device_synchronize(self.device)
        if cuda:
            if self._open:  # what the enclosing stage has seen so far, before the counter restarts for this one
                self._open[-1] = max(self._open[-1], torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        self._open.append(0)
        t0 = time.perf_counter()
        try:
            with progress.stage(name, step=self.step):
                yield
        finally:
            device_synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            seen = self._open.pop()
            if cuda:
                peak = max(seen, torch.cuda.max_memory_allocated(self.device))
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)
                if self._open:
                    self._open[-1] = max(self._open[-1], peak)
                torch.cuda.reset_peak_memory_stats(self.device)

    def metrics(self) -> dict[str, float]:
        """``timing/<stage>`` seconds and, on CUDA, ``memory/peak_gib/<stage>``."""
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory/peak_gib/{k}": v / 2**30 for k, v in self.peak_bytes.items()})
        return out
