"""Dispatch primitives: how data crosses ranks. Every call names the mesh it runs on.

These replace a single controller's RPC fan-out. Control decisions are broadcast from rank 0; prompt
batches are scattered from the mesh's first rank to its DP ranks; results that rank 0 needs (validation
scores) are gathered; metrics are reduced as scalars. Tensors otherwise stay where they were produced.

Object collectives pickle through CPU; the payloads here are prompts, token ids and scalars, small next to
weights (which move through ``rollout/weight_sync.py`` instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.protocol import Batch


def _group_and_src(mesh: DeviceMesh | None):
    if mesh is None:
        return None, 0
    assert mesh.ndim == 1, "dispatch works on a 1-D mesh; pass mesh['dp']"
    group = mesh.get_group()
    return group, dist.get_global_rank(group, 0)


def broadcast_object(obj: Any, *, mesh: DeviceMesh | None = None) -> Any:
    """The value of ``obj`` on the mesh's first rank (global rank 0 for the whole world), on every rank."""
    group, src = _group_and_src(mesh)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def on_main(fn: Callable[[], Any], *, mesh: DeviceMesh | None = None) -> Any:
    """Run ``fn`` on the mesh's first rank and return its result on every rank.

    If ``fn`` raises, every rank raises the same error, so that no rank is left waiting in the next
    collective for a rank that has failed (rank 0 decides; the others must learn the decision, even a bad one).
    """
    group, src = _group_and_src(mesh)
    result = error = None
    if dist.get_rank() == src:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    box = [(result, error)]
    try:
        dist.broadcast_object_list(box, src=src, group=group)
    except Exception:  # an unpicklable result or exception: rank 0 raises its own, the others a summary
        if error is not None:
            raise error from None
        raise
    result, error = box[0]
    if error is not None:
        raise error
    return result


def scatter_batch(batch: Batch | None, *, mesh: DeviceMesh, device: torch.device | None = None) -> Batch:
    """Split ``batch`` (given on the mesh's first rank, ignored elsewhere) into equal consecutive parts, one per DP rank.

    The batch size must divide by the mesh size (``Batch.pad_to_divisor`` first); consecutive parts keep a
    prompt's rows on one rank.
    """
    group, src = _group_and_src(mesh)
    parts = None
    if dist.get_rank() == src:
        parts = batch.to("cpu").chunk(mesh.size())
    out = [None]
    dist.scatter_object_list(out, parts, src=src, group=group)
    return out[0] if device is None else out[0].to(device)


def gather_batch(batch: Batch, *, mesh: DeviceMesh) -> Batch | None:
    """Concatenate every DP rank's batch (in rank order) on the mesh's first rank; None elsewhere."""
    group, dst = _group_and_src(mesh)
    parts = [None] * mesh.size() if dist.get_rank() == dst else None
    dist.gather_object(batch.to("cpu"), parts, dst=dst, group=group)
    return Batch.concat(parts) if parts is not None else None


def all_gather_objects(obj: Any, *, mesh: DeviceMesh) -> list[Any]:
    group, _ = _group_and_src(mesh)
    out = [None] * mesh.size()
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_sum(x: torch.Tensor, *, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum of ``x`` over the mesh (a new tensor; ``x`` is untouched)."""
    y = x.detach().clone()
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return y


class MetricBuffer:
    """Per-rank metric contributions, reduced over a mesh in one collective per reduction kind.

    ``mean(name, total, count)`` reduces to Σtotal/Σcount over ranks (a global mean, not a mean of means);
    ``max``/``min``/``sum`` reduce elementwise. Every rank of the mesh must record the same names.
    """

    def __init__(self):
        self._mean: dict[str, list[float]] = {}
        self._max: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._sum: dict[str, float] = {}

    def mean(self, name: str, total: float | torch.Tensor, count: float | torch.Tensor = 1) -> None:
        acc = self._mean.setdefault(name, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def max(self, name: str, value: float | torch.Tensor) -> None:
        self._max[name] = max(self._max.get(name, -math.inf), float(value))

    def min(self, name: str, value: float | torch.Tensor) -> None:
        self._min[name] = min(self._min.get(name, math.inf), float(value))

    def sum(self, name: str, value: float | torch.Tensor) -> None:
        self._sum[name] = self._sum.get(name, 0.0) + float(value)

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
        """Reduce over the mesh; every rank gets the result."""
        group = None if mesh is None else mesh.get_group()
        n = 1 if mesh is None else mesh.size()
        out: dict[str, float] = {}
        mean_keys = sorted(self._mean)
        sum_keys = sorted(self._sum)
        sums = torch.tensor(
            [v for k in mean_keys for v in self._mean[k]] + [self._sum[k] for k in sum_keys], dtype=torch.float64
        )
        ext_keys = sorted(self._max) + sorted(self._min)
        ext = torch.tensor([self._max[k] for k in sorted(self._max)] + [-self._min[k] for k in sorted(self._min)], dtype=torch.float64)
        if n > 1:
            sums, ext = sums.to(mesh.device_type), ext.to(mesh.device_type)  # NCCL reduces device tensors
            if sums.numel():
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            if ext.numel():
                dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
            sums, ext = sums.cpu(), ext.cpu()
        for i, k in enumerate(mean_keys):
            total, count = sums[2 * i].item(), sums[2 * i + 1].item()
            out[k] = total / count if count else float("nan")
        for i, k in enumerate(sum_keys):
            out[k] = sums[2 * len(mean_keys) + i].item()
        n_max = len(self._max)
        for i, k in enumerate(ext_keys):
            out[k] = ext[i].item() if i < n_max else -ext[i].item()
        return out
