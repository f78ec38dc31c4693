"""Full HF tensors out of a megatron module: for the rollout (``MegatronWeightStream``) and for export
(``MegatronEngine.full_state_dict``).

Each unit (the embedding, a decoder layer, the final norm and head) is gathered over the TP group of the stage that
holds it (pieces cast before gathering), then, with pipeline stages, broadcast from that stage down the pipeline:
every rank of the role sees every unit, in the same order (tied embeddings once, under the embedding's name).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.engines.megatron.modules import MegatronModule, all_gather_flat
from rlspmd.engines.weight_stream import ParamSpec, StreamStats, UnitSpec, WeightManifest, unpack_unit
from rlspmd.models import megatron_convert as mc


@torch.no_grad()
def full_units(module: MegatronModule, dtype: torch.dtype) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Each unit's full HF tensors in ``dtype`` on every rank: one all-gather over the TP group of the stage that
    holds the unit, then, with pipeline stages, one broadcast from that stage down the pipeline. Collective over the
    role's ranks; every rank sees the same units in the same order."""
    g = module.groups
    local = dict(module.units())
    for unit, specs, stage in module.global_units():
        tensors = _gather_tp(module, local[unit], dtype) if stage == g.pp_rank else None
        if g.pp > 1:
            if tensors is not None:
                flat = torch.cat([t.reshape(-1) for _, t in tensors])
            else:
                flat = torch.empty(sum(math.prod(shape) for _, shape in specs), dtype=dtype, device=module.device)
            dist.broadcast(flat, group=g.pp_group, group_src=stage)
            sizes = [math.prod(shape) for _, shape in specs]
            tensors = [(hf, t.view(shape)) for (hf, shape), t in zip(specs, torch.split(flat, sizes))]
        assert [hf for hf, _ in tensors] == [hf for hf, _ in specs], (unit, [hf for hf, _ in tensors])
        yield unit, tensors


def _gather_tp(
    module: MegatronModule, params: list[tuple[str, nn.Parameter]], dtype: torch.dtype
) -> list[tuple[str, torch.Tensor]]:
    """The full HF tensors of this stage's ``params``: one all-gather of the cast pieces over the TP group."""
    g = module.groups
    pieces = [(hf, piece.to(dtype)) for name, p in params for hf, piece in module.hf_pieces(name, p.detach())]
    if g.tp == 1:
        return pieces
    send = torch.cat([piece.reshape(-1) for _, piece in pieces])
    out = send.new_empty(send.numel() * g.tp)
    all_gather_flat(out, send, group=g.tp_group)
    per_rank = out.view(g.tp, -1)
    full, offset = [], 0
    for hf, piece in pieces:
        n = piece.numel()
        parts = [per_rank[r, offset : offset + n].view(piece.shape) for r in range(g.tp)]
        dim = None if hf.startswith("value_head.") else mc.hf_shard_dim(hf)
        full.append((hf, parts[0].clone() if dim is None else torch.cat(parts, dim=dim)))
        offset += n
    return full


class MegatronWeightStream:
    """``rlspmd.engines.base.WeightStream``'s contract for a megatron policy: ``(HF name, full tensor)`` unit
    by unit, the same sequence on every rank of the actor mesh (tied embeddings once, under the embedding's name).

    ``gathered_units`` hands out each unit as one flat buffer in the manifest's single-rank layout (``world`` 1), so
    ``WeightBridge`` broadcasts it to split rollout ranks and ``unpack_unit`` cuts it there unchanged."""

    def __init__(self, module: MegatronModule, *, mesh: DeviceMesh, dtype: torch.dtype):
        self.module, self.mesh, self.device, self.dtype = module, mesh, module.device, dtype
        units = module.global_units()
        self._stages = [stage for _, _, stage in units]
        units = [
            UnitSpec(unit, tuple(ParamSpec(hf, tuple(shape), shape[0]) for hf, shape in specs), 1)
            for unit, specs, _ in units
        ]
        self.manifest = WeightManifest(units=tuple(units), dtype=dtype)
        self.last = StreamStats()

    def stats(self) -> dict[str, float]:
        return {"weight_sync/gathered_bytes": float(self.last.gathered_bytes)}

    def gathered_units(self) -> Iterator[tuple[UnitSpec, torch.Tensor]]:
        self.last = stats = StreamStats()
        g = self.module.groups
        for spec, stage, (_, tensors) in zip(self.manifest.units, self._stages, full_units(self.module, self.dtype)):
            buf = torch.cat([t.reshape(-1) for _, t in tensors])
            nbytes = buf.numel() * buf.element_size()
            stats.units += 1
            # What came from other ranks: the TP peers' pieces (all but replicated tensors, counted as if split), or
            # the whole unit from the stage that holds it.
            stats.gathered_bytes += nbytes * (g.tp - 1) // g.tp if stage == g.pp_rank else nbytes
            stats.peak_unit_bytes = max(stats.peak_unit_bytes, nbytes)
            yield spec, buf
            del buf

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        t0 = time.perf_counter()
        for spec, buf in self.gathered_units():
            for name, tensor in unpack_unit(spec, buf):
                self.last.tensor_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor
        self.last.seconds = time.perf_counter() - t0
