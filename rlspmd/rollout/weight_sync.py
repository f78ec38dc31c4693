"""Split placement's weight transport: the actor's gathered units, broadcast to disjoint rollout ranks.

The actor ranks gather each FSDP2 unit as the weight stream does (``engines/weight_stream.py``), and the actor's
first rank broadcasts the gathered buffer to the rollout ranks on a group of those ranks only; the receivers cut the
same tensors out of it. The actor ranks never block on the rollout ranks except in that broadcast, and the only rank
in both groups (the actor's first) runs them in a fixed order, so there is no cycle to deadlock on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlspmd.engines.weight_stream import StreamStats, WeightManifest, WeightStream


class WeightBridge:
    """Weights from the actor mesh to disjoint rollout ranks (split placement).

    ``mesh`` is the 1-D link over the actor's first rank and the rollout ranks (None on the other actor ranks,
    which only take part in the gathers). Per unit: gather on the actor mesh, broadcast from the actor's first
    rank on ``mesh``. The manifest crosses once, on the first sync.
    """

    def __init__(self, mesh, *, src: int, device: torch.device):
        self.mesh, self.src, self.device = mesh, src, device
        self.manifest: WeightManifest | None = None
        self.received_bytes = 0

    def _share_manifest(self, manifest: WeightManifest | None) -> WeightManifest:
        if self.manifest is None:
            box = [manifest]
            dist.broadcast_object_list(box, src=self.src, group=self.mesh.get_group())
            self.manifest = box[0]
        return self.manifest

    def send(self, stream: WeightStream) -> StreamStats:
        """Actor ranks: gather every unit; the first actor rank also broadcasts it."""
        if self.mesh is not None:
            self._share_manifest(stream.manifest)
        for _, buf in stream.gathered_units():
            if self.mesh is not None:
                dist.broadcast(buf, src=self.src, group=self.mesh.get_group())
            del buf
        return stream.last

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rollout ranks: the same ``(name, tensor)`` sequence the actor ranks' stream yields."""
        manifest = self._share_manifest(None)
        self.received_bytes = 0
        for spec in manifest.units:
            buf = torch.empty(spec.gathered_numel, dtype=manifest.dtype, device=self.device)
            dist.broadcast(buf, src=self.src, group=self.mesh.get_group())
            self.received_bytes += buf.numel() * buf.element_size()
            yield from manifest.hand_out(spec, buf)
            del buf
