"""Metric sinks behind one interface, used by rank 0 only: console (tqdm), jsonl, TensorBoard.

Metrics arrive already reduced over ranks (``MetricBuffer.reduce``); the logger only writes them.
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
            self.jsonl = open(out / "metrics.jsonl", "a", buffering=1)
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out / "tensorboard"))

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
