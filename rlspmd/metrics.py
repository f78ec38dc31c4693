"""Metrics: per-rank contributions (``MetricBuffer``), reduced over a mesh once per step, then written by rank 0
through one small logger interface (``MetricLogger``: console, jsonl, TensorBoard, and the experiment trackers W&B,
MLflow and Trackio of ``rlspmd.trackers``).

A step's stages write into one ``MetricBuffer``. Contributions may be Python numbers or tensors on any device; tensors
are accumulated on their device (float64) and never read back one by one, so recording a metric inside a training
loop costs no host round trip: the only device-to-host copy is the single reduction at the end of the step.

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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.trackers import TRACKERS, Trackers

Number = float | int | torch.Tensor


def _f64(x: Number) -> Number:
    """A contribution as float64: tensors stay on their device (no sync), Python numbers stay Python floats."""
    return x.detach().to(torch.float64) if isinstance(x, torch.Tensor) else float(x)


class MetricBuffer:
    """Per-rank metric contributions, reduced over a mesh in one collective per reduction kind.

    ``mean(name, total, count)`` reduces to Σtotal/Σcount over ranks (a global mean, not a mean of means);
    ``max``/``min``/``sum`` reduce elementwise. Every rank of the mesh must record the same names. Contributions are
    accumulated in float64 in the order they arrive, exactly as Python floats would be.
    """

    def __init__(self):
        self._mean: dict[str, list[Number]] = {}
        self._max: dict[str, Number] = {}
        self._min: dict[str, Number] = {}
        self._sum: dict[str, Number] = {}

    def mean(self, name: str, total: Number, count: Number = 1) -> None:
        acc = self._mean.setdefault(name, [0.0, 0.0])
        acc[0] = acc[0] + _f64(total)
        acc[1] = acc[1] + _f64(count)

    def max(self, name: str, value: Number) -> None:
        self._max[name] = _extreme(self._max.get(name), _f64(value), torch.maximum, max)

    def min(self, name: str, value: Number) -> None:
        self._min[name] = _extreme(self._min.get(name), _f64(value), torch.minimum, min)

    def sum(self, name: str, value: Number) -> None:
        self._sum[name] = self._sum.get(name, 0.0) + _f64(value)

    def merge(self, other: "MetricBuffer") -> "MetricBuffer":
        """Fold another buffer's contributions into this one (names must not overlap across kinds)."""
        for k, (total, count) in other._mean.items():
            self.mean(k, total, count)
        for k, v in other._max.items():
            self.max(k, v)
        for k, v in other._min.items():
            self.min(k, v)
        for k, v in other._sum.items():
            self.sum(k, v)
        return self

    def reduce(self, *, mesh: DeviceMesh | None) -> dict[str, float]:
        """Reduce over the mesh (None: this rank alone); every rank gets the result. One host copy in all."""
        n = 1 if mesh is None else mesh.size()
        device = torch.device(mesh.device_type) if mesh is not None and n > 1 else torch.device("cpu")
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        mean_keys, sum_keys = sorted(self._mean), sorted(self._sum)
        max_keys, min_keys = sorted(self._max), sorted(self._min)
        sums = _vector([v for k in mean_keys for v in self._mean[k]] + [self._sum[k] for k in sum_keys], device)
        ext = _vector([self._max[k] for k in max_keys] + [-self._min[k] for k in min_keys], device)
        if n > 1:  # NCCL reduces device tensors, Gloo CPU ones
            group = mesh.get_group()
            if sums.numel():
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            if ext.numel():
                dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
        sums, ext = sums.tolist(), ext.tolist()
        out: dict[str, float] = {}
        for i, k in enumerate(mean_keys):
            total, count = sums[2 * i], sums[2 * i + 1]
            out[k] = total / count if count else float("nan")
        for i, k in enumerate(sum_keys):
            out[k] = sums[2 * len(mean_keys) + i]
        for i, k in enumerate(max_keys):
            out[k] = ext[i]
        for i, k in enumerate(min_keys):
            out[k] = -ext[len(max_keys) + i]
        return out


def _extreme(old: Number | None, new: Number, tensor_fn, number_fn) -> Number:
    if old is None:
        return new
    if not isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor):
        return number_fn(old, new)
    device = (new if isinstance(new, torch.Tensor) else old).device
    return tensor_fn(_scalar(old, device), _scalar(new, device))


def _scalar(x: Number, device: torch.device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``; a Python number is written there by a fill, not copied from the host."""
    if isinstance(x, torch.Tensor):
        return x.reshape(()).to(device=device, dtype=torch.float64)
    return torch.full((), x, dtype=torch.float64, device=device)


def _vector(values: list[Number], device: torch.device) -> torch.Tensor:
    """One float64 vector on ``device`` of Python numbers and 0-dim tensors."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([_scalar(v, device) for v in values])


SINKS = ("console", "jsonl", "tensorboard", *TRACKERS)
"""What ``trainer.loggers`` can name."""

CONSOLE_KEYS = ("reward/mean", "acc/mean", "actor/kl_loss", "actor/entropy", "response_length/mean", "timing/step")


class MetricLogger:
    def __init__(
        self,
        sinks: list[str],
        output_dir: str,
        *,
        total_steps: int,
        initial_step: int = 0,
        enabled: bool = True,
        trackers: Trackers | None = None,
    ):
        """``enabled``: this rank writes (rank 0). ``trackers``: the experiment trackers among ``sinks``, with their
        settings and run ids (None: ``TrackerConfig``'s defaults, a fresh run each)."""
        unknown = set(sinks) - set(SINKS)
        if unknown:
            raise ValueError(f"trainer.loggers: unknown sink(s) {sorted(unknown)}; choose from {', '.join(SINKS)}")
        self.enabled = enabled
        self.bar = self.jsonl = self.tb = None
        self.trackers = trackers if trackers is not None else Trackers(sinks, output_dir=output_dir)
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.trackers.start(write=self.write)  # before the bar: they print as they start
        if "console" in sinks:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="rlspmd", dynamic_ncols=True, file=sys.stdout)
        if "jsonl" in sinks:
            path = out / "metrics.jsonl"
            if path.exists():
                rewind_jsonl(path, initial_step)
            self.jsonl = open(path, "a", buffering=1)
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard then hides older events from this step on (the files stay on disk)
            self.tb = SummaryWriter(
                log_dir=str(out / "tensorboard"), purge_step=initial_step + 1 if initial_step else 0
            )

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
        self.trackers.log(step, metrics)
        if self.bar is not None:
            shown = {
                k.split("/")[0] if k.endswith("/mean") else k.split("/")[-1]: f"{metrics[k]:.3g}"
                for k in CONSOLE_KEYS
                if k in metrics
            }
            if advance:
                self.bar.set_postfix(shown, refresh=False)
                self.bar.update(1)
            vals = {k: f"{v:.4g}" for k, v in metrics.items() if k.startswith("val/")}
            if vals:
                self.bar.write(f"step {step} validation: " + ", ".join(f"{k}={v}" for k, v in sorted(vals.items())))

    def text(self, tag: str, text: str, step: int) -> None:
        """A text entry in TensorBoard's text tab (the sample log's conversations); nothing without that sink. Shown
        with the step's metrics, which flush the writer."""
        if self.tb is not None:
            self.tb.add_text(tag, text, step)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        """A table for the experiment trackers (the sample log's ``samples/train``, ``samples/val``); rows are dicts
        with the same keys. Nothing without a tracker."""
        if self.enabled:
            self.trackers.table(name, rows, step)

    def image(self, tag: str, image_HWC, step: int) -> None:
        """An image (uint8, height x width x 3) in TensorBoard's images tab (the sample log's prompts' images);
        nothing without that sink."""
        if self.tb is not None:
            self.tb.add_image(tag, image_HWC, step, dataformats="HWC")

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.trackers.close()  # first: its warnings still reach the console
        for sink in (self.bar, self.jsonl, self.tb):
            if sink is not None:
                sink.close()


def _finite(metrics: dict) -> dict:
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}


def rewind_jsonl(path: Path, step: int) -> None:
    """Keep the lines of steps <= ``step`` (none for a fresh start); move the others to ``<stem>.superseded.jsonl``."""
    keep, drop = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            s = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            s = None  # a torn last line from a killed run
        (keep if step and s is not None and s <= step else drop).append(line)
    if not drop:
        return
    with open(path.with_name(f"{path.stem}.superseded.jsonl"), "a") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line in drop)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)
