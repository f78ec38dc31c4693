"""Dispatch primitives: how data crosses ranks. Every call names the mesh it runs on.

These replace a single controller's RPC fan-out. Control decisions are broadcast from rank 0; prompt
batches are scattered from the mesh's first rank to its DP ranks; results that rank 0 needs (validation
scores) are gathered; metrics are reduced as scalars. Tensors otherwise stay where they were produced.

Between disjoint meshes (split placement) batches move with ``redistribute_batch``: one all-to-all over a
link mesh that spans both, rows keeping their global order, each rank sending only the rows another rank needs
(no relay through rank 0).

Object collectives pickle through CPU; the payloads here are prompts, token ids and scalars, small next to
weights (which move through ``rollout/weight_sync.py`` instead).
"""

from __future__ import annotations

import pickle
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
    """Split ``batch`` (given on the mesh's first rank, ignored elsewhere) into equal consecutive parts,
    one per DP rank.

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


def all_to_all_objects(objs: list[Any], *, mesh: DeviceMesh) -> list[Any]:
    """Rank ``i`` of the mesh sends ``objs[j]`` to rank ``j``; returns what each rank sent this one, by sender.

    Two tensor all-to-alls (sizes, then pickled bytes) on the mesh's device: NCCL moves device tensors, Gloo CPU.
    """
    group, _ = _group_and_src(mesh)
    n = mesh.size()
    assert len(objs) == n, f"all_to_all_objects: {len(objs)} objects for a mesh of {n} ranks"
    if n == 1:
        return list(objs)
    device = _comm_device(mesh)
    payloads = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=device)
    recv_sizes = torch.empty(n, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    blob = b"".join(payloads)
    send = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        if blob
        else torch.empty(0, dtype=torch.uint8, device=device)
    )
    recv_list = recv_sizes.tolist()
    recv = torch.empty(sum(recv_list), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_list, input_split_sizes=send_sizes.tolist(), group=group)
    data = recv.cpu().numpy().tobytes()
    out, offset = [], 0
    for size in recv_list:
        out.append(pickle.loads(data[offset : offset + size]))
        offset += size
    return out


def _comm_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` rows in ``parts`` consecutive parts whose sizes differ by at most one (larger parts first)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def redistribute_batch(
    batch: Batch | None,
    *,
    mesh: DeviceMesh,
    sizes_in: list[int],
    sizes_out: list[int],
    device: torch.device | None = None,
) -> Batch:
    """Move rows between the ranks of ``mesh`` keeping their global order; one all-to-all.

    The global batch is the concatenation of every rank's rows in mesh-rank order; rank ``k`` holds
    ``sizes_in[k]`` of them before and ``sizes_out[k]`` after. Every rank passes the same two lists. A rank that
    holds nothing passes None (or an empty Batch) and gets an empty ``Batch()`` back when it receives nothing.
    Used between disjoint meshes (split placement): actor DP ranks -> rollout ranks and back.
    """
    n = mesh.size()
    me = mesh.get_local_rank()
    assert len(sizes_in) == len(sizes_out) == n and sum(sizes_in) == sum(sizes_out), (sizes_in, sizes_out)
    have = 0 if batch is None else len(batch)
    assert have == sizes_in[me], f"rank {me} of the link holds {have} rows, the plan says {sizes_in[me]}"
    start = sum(sizes_in[:me])
    parts: list[Batch | None] = []
    dst_start = 0
    for k in range(n):  # the slice of my rows that rank k owns afterwards
        lo, hi = max(start, dst_start), min(start + have, dst_start + sizes_out[k])
        parts.append(batch.slice(lo - start, hi - start).to("cpu") if hi > lo else None)
        dst_start += sizes_out[k]
    received = [b for b in all_to_all_objects(parts, mesh=mesh) if b is not None]
    out = Batch.concat(received) if received else Batch()
    assert len(out) == sizes_out[me], (len(out), sizes_out[me])
    return out if device is None or not received else out.to(device)


def all_reduce_sum(x: torch.Tensor, *, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum of ``x`` over the mesh (a new tensor; ``x`` is untouched)."""
    y = x.detach().clone()
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return y


def all_reduce_max(x: torch.Tensor, *, mesh: DeviceMesh | None) -> torch.Tensor:
    """Elementwise max of ``x`` over the mesh (a new tensor; ``x`` is untouched)."""
    y = x.detach().clone()
    if mesh is not None and mesh.size() > 1:
        y = y.to(mesh.device_type)
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return y.to(x.device)


def all_to_all_batch(batch: Batch, dest_B: list[int], *, mesh: DeviceMesh) -> Batch:
    """Rows of ``batch`` move to the DP rank ``dest_B[i]`` of the mesh; returns the rows this rank receives.

    Received rows come in source-rank order (a source's rows keep their order). Ranks may hold different padded
    widths, so the result is re-padded by ``Batch.concat_padded``.
    """
    n = mesh.size()
    assert len(dest_B) == len(batch), (len(dest_B), len(batch))
    device = next(iter(batch.tensors.values())).device if batch.tensors else torch.device("cpu")
    parts = [batch.select([i for i, d in enumerate(dest_B) if d == r]).to("cpu") for r in range(n)]
    return Batch.concat_padded(all_to_all_objects(parts, mesh=mesh)).to(device)


def balance_batch(batch: Batch, *, mesh: DeviceMesh, chunk_rows: int) -> tuple[Batch, dict[str, float]]:
    """Move rows between the DP ranks so that each holds about the same number of tokens (``attention_mask_BL``).

    Balancing happens inside each mini-batch, so every optimiser step still sees the same samples: rank r's rows
    ``[j * chunk_rows, (j + 1) * chunk_rows)`` are its share of global mini-batch ``j``; the union of those shares is
    partitioned into equal-count, token-balanced parts (``karmarkar_karp``), and each rank's new rows
    ``[j * chunk_rows, ...)`` are one part. Each part goes to the rank that already holds most of its rows, so little
    moves. Call after group statistics (advantages) are computed: a prompt's samples may end up on different ranks.

    Returns the new local batch and ``balance/token_imbalance_{before,after}`` (max / mean tokens over ranks).
    """
    from rlspmd.data.balance import imbalance, karmarkar_karp

    n, me = mesh.size(), mesh.get_local_rank()
    if n == 1:
        return batch, {"balance/token_imbalance_before": 1.0, "balance/token_imbalance_after": 1.0}
    tokens = all_gather_objects(batch["attention_mask_BL"].sum(-1).tolist(), mesh=mesh)
    sizes = {len(t) for t in tokens}
    if len(sizes) > 1:
        raise ValueError(f"balance_batch: DP ranks hold different numbers of samples {[len(t) for t in tokens]}")
    rows = sizes.pop()
    dest = [[0] * rows for _ in range(n)]  # dest[rank][row] = new rank of that row, known on every rank
    for start in range(0, rows, chunk_rows):
        items = [(r, i) for r in range(n) for i in range(start, min(start + chunk_rows, rows))]
        parts = karmarkar_karp([tokens[r][i] for r, i in items], n, equal_size=True)
        taken: set[int] = set()
        for part in sorted(parts, key=lambda p: -max(sum(items[x][0] == r for x in p) for r in range(n))):
            owner = max((r for r in range(n) if r not in taken), key=lambda r: sum(items[x][0] == r for x in part))
            taken.add(owner)
            for x in part:
                r, i = items[x]
                dest[r][i] = owner
    received = all_to_all_batch(batch, dest[me], mesh=mesh)
    # Received rows come in source-rank order; put them back in mini-batch order (stable, so deterministic).
    chunk_of = [i // chunk_rows for r in range(n) for i in range(rows) if dest[r][i] == me]
    received = received.select(sorted(range(len(chunk_of)), key=lambda x: chunk_of[x]))
    before = [float(sum(t)) for t in tokens]
    after = [0.0] * n
    for r in range(n):
        for i in range(rows):
            after[dest[r][i]] += tokens[r][i]
    return received, {
        "balance/token_imbalance_before": imbalance(before),
        "balance/token_imbalance_after": imbalance(after),
    }
