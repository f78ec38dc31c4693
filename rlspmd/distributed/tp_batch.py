"""Micro-batches of a tensor-parallel group: every TP rank runs the whole group's rows, each keeps its own.

The trainer hands every rank of a training role its own samples (data is dispatched per rank, whatever the
engine's parallelism). Under tensor parallelism the ranks of a TP group must run the *same* forward, so both
training engines with TP (``engines/fsdp`` with ``mesh.actor_tp``, ``engines/megatron``) do the same three
things per micro-batch:

1. ``all_gather_varlen``: all-gather the members' integer inputs (shapes may differ: rows, padded length), two
   all-gathers on the TP group (the shapes, then one padded flat buffer);
2. run the model once on the concatenated rows (``members_rows`` says whose rows are whose);
3. ``keep_own_rows``: each rank keeps its own rows of the outputs. Under autograd the outputs first pass
   ``SumGradOverGroup``: each rank's loss reads only its own rows, so the output gradient is summed over the group
   and every TP rank back-propagates the gradient of the group's *total* loss, which is what the sharded matmuls
   need. Replicated parameters (norms, embeddings) then get the same full gradient on every TP rank, so the DP
   reduction (over the ``dp`` dim only) sums each sample's gradient exactly once: nothing is counted twice.

The group's micro-batch counts must agree (``distributed/micro_batches.split_micro_batches`` agrees the count over the
role's mesh, which contains the TP group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group``. Applied to outputs every TP rank computed for
    the whole TP group's rows, of which each rank's loss used only its own: after the sum every rank holds the
    gradient of the group's total loss."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_gather_varlen(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """Every member's ``tensors`` (in group-rank order), whose shapes may differ between members (same count, ranks
    and dtypes). Integer or bool tensors only (they travel as int64, exactly). Two all-gathers on ``group``."""
    assert all(not t.is_floating_point() for t in tensors), "all_gather_varlen moves integer (exact) tensors only"
    n = dist.get_world_size(group)
    device = tensors[0].device
    dims = torch.tensor([s for t in tensors for s in t.shape], dtype=torch.long, device=device)
    all_dims = [torch.empty_like(dims) for _ in range(n)]
    dist.all_gather(all_dims, dims, group=group)
    shapes: list[list[torch.Size]] = []
    for d in all_dims:
        d, member, at = d.tolist(), [], 0
        for t in tensors:
            member.append(torch.Size(d[at : at + t.dim()]))
            at += t.dim()
        shapes.append(member)
    sizes = [[math.prod(s) for s in member] for member in shapes]
    flat = torch.cat([t.reshape(-1).long() for t in tensors])
    buf = F.pad(flat, (0, max(sum(s) for s in sizes) - flat.numel()))
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    out = []
    for member, size, x in zip(shapes, sizes, bufs):
        parts = torch.split(x[: sum(size)], size)
        out.append([p.view(s).to(t.dtype) for p, s, t in zip(parts, member, tensors)])
    return out


def gather_group_rows(
    tensors_BL: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> tuple[list[torch.Tensor], list[int]]:
    """The TP group's ``(B, L)`` inputs (token ids, attention mask, position ids) concatenated in group-rank order,
    each member's rows left-padded with zeros to the longest ``L`` (padding is masked out: the last columns, the
    responses, keep their place); and each member's row count."""
    members = all_gather_varlen(tensors_BL, group)
    width = max(m[0].shape[1] for m in members)
    cat = [torch.cat([F.pad(m[i], (width - m[i].shape[1], 0)) for m in members]) for i in range(len(tensors_BL))]
    return cat, [m[0].shape[0] for m in members]


def keep_own_rows(out: torch.Tensor, rows: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's rows of ``out`` (the group's rows, as ``gather_group_rows`` ordered them); under autograd the
    gradient reaching ``out`` is summed over the group first (``SumGradOverGroup``)."""
    rank = dist.get_rank(group)
    start = sum(rows[:rank])
    if out.requires_grad:
        out = SumGradOverGroup.apply(out, group)
    return out[start : start + rows[rank]]
