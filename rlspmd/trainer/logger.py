"""Metric sinks behind one interface, used by rank 0 only: console (tqdm), jsonl, TensorBoard.

Metrics arrive already reduced over ranks (``MetricBuffer.reduce``); the logger only writes them.

Resuming at step N continues the same files: ``metrics.jsonl`` keeps its lines up to step N and appends
from N + 1; lines after N (steps the crashed run logged after its last checkpoint, now run again) move to
``metrics.superseded.jsonl``; TensorBoard hides earlier events after N. A fresh start (N = 0) supersedes
all of an earlier run's metrics.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

CONSOLE_KEYS = ("reward/mean", "acc/mean", "actor/kl_loss", "actor/entropy", "response_length/mean", "timing/step")


class MetricLogger:
    def __init__(self, sinks: list[str], output_dir: str, *, total_steps: int, initial_step: int = 0, enabled: bool = True):
        unknown = set(sinks) - {"console", "jsonl", "tensorboard"}
        if unknown:
            raise ValueError(f"trainer.loggers: unknown sink(s) {sorted(unknown)}; choose from console, jsonl, tensorboard")
        self.enabled = enabled
        self.bar = self.jsonl = self.tb = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if "console" in sinks:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="rlspmd", dynamic_ncols=True, file=sys.stdout)
        if "jsonl" in sinks:
            path = out / "metrics.jsonl"
            if path.exists():
                _rewind_jsonl(path, initial_step)
            self.jsonl = open(path, "a", buffering=1)
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard then hides older events from this step on (the files stay on disk)
            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=initial_step + 1 if initial_step else 0)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "time": time.time(), **_finite(metrics)}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.bar is not None:
            shown = {k.split("/")[0] if k.endswith("/mean") else k.split("/")[-1]: f"{metrics[k]:.3g}" for k in CONSOLE_KEYS if k in metrics}
            if advance:
                self.bar.set_postfix(shown, refresh=False)
                self.bar.update(1)
            vals = {k: f"{v:.4g}" for k, v in metrics.items() if k.startswith("val/")}
            if vals:
                self.bar.write(f"step {step} validation: " + ", ".join(f"{k}={v}" for k, v in sorted(vals.items())))

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for sink in (self.bar, self.jsonl, self.tb):
            if sink is not None:
                sink.close()


def _finite(metrics: dict) -> dict:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}


def _rewind_jsonl(path: Path, step: int) -> None:
    """Keep the lines of steps <= ``step`` (none for a fresh start); move the others to ``*.superseded.jsonl``."""
    keep, drop = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            s = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            s = None  # a torn last line from a killed run
        (keep if step and s is not None and s <= step else drop).append(line)
    if not drop:
        return
    with open(path.with_name("metrics.superseded.jsonl"), "a") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in drop)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
