"""Micro-batches for the roles' passes: a fixed number of samples, or a token budget (dynamic batching).

With a token budget (``max_tokens_per_micro_batch``) a rank's samples are split into token-balanced micro-batches
whose valid tokens (``attention_mask_BL``) stay within the budget, so a micro-batch of short samples holds many and
one of long samples few. Under FSDP every rank must run the same number of forwards (and backwards): each
forward all-gathers parameters. The count is therefore agreed over the DP mesh first (the max of what each rank
needs, for fixed-size micro-batches too), and each rank splits its samples into exactly that many micro-batches. A
rank that needs fewer (it holds fewer samples or fewer tokens) fills up with zero-weight micro-batches: a copy of one
sample with an empty response mask, which adds nothing to a masked loss and whose outputs are discarded.

Loss normalisation is unaffected: losses are divided by global token/sequence counts of the mini-batch
(``rlspmd.algorithms.aggregation``), so how the mini-batch is cut into micro-batches does not change the gradient.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.data.balance import count_micro_batches, micro_batch_plan
from rlspmd.distributed.dispatch import all_reduce_max
from rlspmd.protocol import Batch


def token_counts(batch: Batch) -> list[int]:
    """Valid tokens (prompt + response) of each sample."""
    return batch["attention_mask_BL"].sum(-1).tolist()


MASKS = ("response_mask_BR", "loss_mask_BR")
"""The masks a zero-weight copy empties (a scoring pass has neither: its output is simply discarded)."""


def zero_weight_copy(batch: Batch) -> Batch:
    """One sample whose response masks are empty: it runs through the model but contributes nothing to a masked loss."""
    row = batch.select([0])
    return row.set(**{k: torch.zeros_like(row[k]) for k in MASKS if k in row})


def split_micro_batches(
    batch: Batch, *, micro_batch_size: int, max_tokens: int | None, mesh: DeviceMesh | None
) -> list[tuple[list[int], Batch]]:
    """``(row indices, micro-batch)`` pairs covering ``batch``; zero-weight fillers have no row indices.

    ``max_tokens=None``: consecutive ``micro_batch_size`` rows; otherwise token-balanced micro-batches within the
    budget. Either way the count is agreed over ``mesh`` (one all-reduce, which every rank of the mesh must join), so
    ranks holding different numbers of samples still run the same number of forwards.
    """
    n = len(batch)
    if max_tokens is None:
        parts = [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
        wanted = len(parts)
    else:
        tokens = token_counts(batch)
        wanted = count_micro_batches(tokens, max_tokens)
    count = int(all_reduce_max(torch.tensor([max(wanted, 1)]), mesh=mesh)[0])
    if max_tokens is None:
        parts += [[] for _ in range(count - len(parts))]
    else:
        parts = micro_batch_plan(tokens, count)
    if n == 0:
        raise ValueError("a DP rank has no samples for this pass; every rank needs at least one")
    return [(rows, batch.select(rows) if rows else zero_weight_copy(batch)) for rows in parts]


def forward_micro_batches(batch: Batch, fn, *, micro_batch_size: int, max_tokens: int | None, mesh: DeviceMesh | None):
    """``fn(micro_batch)`` (a tensor, or a tuple of tensors, per row) over ``split_micro_batches``, reassembled in the
    batch's row order as float32 tensors. Zero-weight fillers run (they keep the ranks' FSDP collectives in step) but
    their outputs are dropped."""
    outs: list[torch.Tensor] | None = None
    single = False
    for rows, mb in split_micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens, mesh=mesh):
        res = fn(mb)
        single = not isinstance(res, tuple)
        res = (res,) if single else res
        if outs is None:
            outs = [r.new_zeros((len(batch), *r.shape[1:]), dtype=torch.float32) for r in res]
        if rows:
            idx = torch.tensor(rows, device=outs[0].device)
            for out, r in zip(outs, res):
                out[idx] = r.float()
    return outs[0] if single else tuple(outs)
