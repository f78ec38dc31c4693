"""The FSDP2 engine's weight stream: its parameters as ``(Hugging Face name, full tensor)``, unit by unit.

One implementation feeds every rollout engine (the native engine's own copy, vLLM's loader) in every placement
(``FSDPEngine.weight_stream``; split placement forwards the gathered units with ``rollout/weight_sync.py``).

*Units* are FSDP2's own sharding units, walked in model order: the embedding, each decoder layer, then the
rest of the root (final norm, an untied LM head). Per unit, every rank of the actor's DP mesh

1. casts its local shards to the rollout dtype (so a bf16 rollout never gathers fp32 master weights),
2. packs them into one flat buffer, each parameter padded to ``ceil(rows / world)`` rows (FSDP2 shards dim 0
   with ``torch.chunk``, so the last ranks may hold fewer rows, or none),
3. gathers the unit with ONE flat all-gather on the actor's DP group,

and the full tensors are then cut out of the gathered buffer one at a time. Peak extra memory is one gathered
unit plus the tensor being handed out; nothing is materialised as a full state dict. Every rank runs the same
collectives in the same order, and every rank gets every tensor.

Names are the HF model's own parameter names (``model.layers.3.self_attn.q_proj.weight``), with wrapper
fragments (activation checkpointing, ``torch.compile``) stripped. Tied embeddings appear once, under the input
embedding's name: ``named_parameters`` yields a shared parameter once, and vLLM's loader and ``OwnWeights``
both tie the head to it. Buffers (rotary tables) are not streamed: they are constants of the architecture.

**Tensor parallel + FSDP2** (the engine's ``train_mesh``): parameters are DTensors on the 2-D ``(dp, tp)`` mesh (TP
weights) or on its ``dp`` dim (norms, embeddings). Each is cast to the rollout dtype *as a DTensor* (on the shard) and
gathered with ``full_tensor()``; a unit's full tensors are packed into one buffer laid out as a one-rank unit
(``UnitSpec.world == 1``), so everything downstream (``unpack_unit``, the split placement's bridge) is unchanged.
Every rank of the actor gets every tensor, as with FSDP alone.

**Expert parallel + FSDP2** (the engine's ``expert_mesh``): the experts are 2-D DTensors on ``(edp, ep)``, gathered
the same way as tensor-parallel weights (every unit through the per-tensor path).

Simplifications: on the FSDP path parameters must be FSDP2 ``Shard(0)`` DTensors on a 1-D mesh; HSDP is not handled.
The gather of unit k+1 does not overlap the hand-off of unit k. The TP path gathers per tensor (one collective per
tensor, not one per unit) and hands out full tensors, not rollout-TP shards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from rlspmd.models.loader import decoder_layers
from rlspmd.models.lora import merge_lora

WRAPPER_FRAGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """A parameter's Hugging Face checkpoint name: wrapper fragments removed."""
    for frag in WRAPPER_FRAGMENTS:
        name = name.replace(frag, "")
    return name


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    chunk: int
    """Rows of dim 0 per rank in the gathered buffer: ``ceil(shape[0] / world)``."""

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    def rows(self, rank: int) -> int:
        """Rows rank ``rank`` holds (FSDP2's ``torch.chunk`` layout)."""
        return max(0, min(self.chunk, self.shape[0] - rank * self.chunk))


@dataclass(frozen=True)
class UnitSpec:
    name: str
    params: tuple[ParamSpec, ...]
    world: int

    @property
    def numel_per_rank(self) -> int:
        return sum(p.chunk * p.row_numel for p in self.params)

    @property
    def gathered_numel(self) -> int:
        return self.world * self.numel_per_rank

    @property
    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)


@dataclass(frozen=True)
class WeightManifest:
    """What a weight stream sends: units in order, their parameters, the dtype. Small and picklable, so it can be
    sent to ranks that do not hold the model."""

    units: tuple[UnitSpec, ...]
    dtype: torch.dtype
    lora_scaling: float | None = None
    """The actor trains LoRA adapters with this scaling: each unit's base weights and adapters are merged into plain HF
    weights (``models/lora.py: merge_lora``) before they are handed out (``hand_out``)."""

    def names(self) -> list[str]:
        return [p.name for u in self.units for p in u.params]

    def hand_out(self, spec: UnitSpec, gathered: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A gathered unit's ``(HF name, full tensor)`` pairs as a rollout engine loads them."""
        pairs = unpack_unit(spec, gathered)
        return pairs if self.lora_scaling is None else merge_lora(pairs, self.lora_scaling)

    @property
    def nbytes(self) -> int:
        """Bytes of the full model in the stream's dtype."""
        return sum(u.numel for u in self.units) * _itemsize(self.dtype)

    @property
    def max_unit_bytes(self) -> int:
        """The largest gathered buffer (padding included): the stream's peak extra memory, less one tensor."""
        return max(u.gathered_numel for u in self.units) * _itemsize(self.dtype)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, *, group) -> None:
    """One flat all-gather (``all_gather_single`` from torch 2.13 on, ``all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _units(hf_model: nn.Module) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """(unit name, [(HF name, param)]) in model order: embedding, decoder layers, the rest of the root."""
    module_names = {id(m): n for n, m in hf_model.named_modules()}
    embed = hf_model.get_input_embeddings()
    layer_prefixes = [module_names[id(layer)] + "." for layer in decoder_layers(hf_model)]
    embed_prefix = module_names[id(embed)] + "."
    head: list = []
    embed_params: list = []
    layers: list[list] = [[] for _ in layer_prefixes]
    for name, p in hf_model.named_parameters():  # a tied weight appears once, under its first name
        if name.startswith(embed_prefix):
            embed_params.append((hf_name(name), p))
            continue
        for i, prefix in enumerate(layer_prefixes):
            if name.startswith(prefix):
                layers[i].append((hf_name(name), p))
                break
        else:
            head.append((hf_name(name), p))
    units = [("embed", embed_params)] + [(f"layers.{i}", ps) for i, ps in enumerate(layers)] + [("head", head)]
    return [(n, ps) for n, ps in units if ps]


def _local_shard(p: torch.Tensor) -> torch.Tensor:
    assert isinstance(p, DTensor), "the weight stream reads FSDP2-sharded (DTensor) parameters"
    assert p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),), (
        f"the weight stream handles FSDP2 Shard(0) on a 1-D mesh, got {p.placements} on a {p.device_mesh.ndim}-D mesh"
    )
    return p.to_local().detach()


@dataclass
class StreamStats:
    """What one pass of a stream did on this rank."""

    seconds: float = 0.0
    units: int = 0
    gathered_bytes: int = 0
    """Bytes this rank received from its peers in the unit all-gathers."""
    tensor_bytes: int = 0
    """Bytes of the full tensors handed out."""
    peak_unit_bytes: int = 0
    """The largest gathered buffer (the transient memory besides one handed-out tensor)."""
    extra: dict = field(default_factory=dict)


class WeightStream:
    """The actor engine's weights, gathered unit by unit in ``dtype``; iterate it on every rank of the actor mesh."""

    def __init__(self, engine, *, dtype: torch.dtype, lora_scaling: float | None = None):
        """``lora_scaling``: the engine trains LoRA adapters (``engines/fsdp/lora.py``); hand out merged weights."""
        self.hf_model = engine.hf_model
        self.mesh = engine.mesh
        self.device = engine.device
        self.dtype = dtype
        self._units = _units(self.hf_model)
        # TP and EP weights are 2-D DTensors: gathered per tensor
        self.tensor_parallel = engine.train_mesh is not None or engine.expert_mesh is not None
        # the TP path hands out whole tensors: each unit laid out as on one rank
        world = 1 if self.tensor_parallel else self.mesh.size()
        self.manifest = WeightManifest(
            units=tuple(
                UnitSpec(
                    name, tuple(ParamSpec(n, tuple(p.shape), math.ceil(p.shape[0] / world)) for n, p in params), world
                )
                for name, params in self._units
            ),
            dtype=dtype,
            lora_scaling=lora_scaling,
        )
        self.last = StreamStats()

    def gathered_units(self) -> Iterator[tuple[UnitSpec, torch.Tensor]]:
        """Each unit's gathered flat buffer (``world x numel_per_rank``), in order. Collective on the actor mesh."""
        group, rank = self.mesh.get_group(), self.mesh.get_local_rank()
        self.last = stats = StreamStats()
        t0 = time.perf_counter()
        if self.tensor_parallel:
            yield from self._full_tensor_units(stats)
            stats.seconds = time.perf_counter() - t0
            return
        for spec, (_, params) in zip(self.manifest.units, self._units):
            send = torch.empty(spec.numel_per_rank, dtype=self.dtype, device=self.device)
            offset = 0
            for ps, (_, p) in zip(spec.params, params):
                local = _local_shard(p)
                rows = ps.rows(rank)
                assert local.shape[0] == rows, f"{ps.name}: local shard has {local.shape[0]} rows, expected {rows}"
                block = send[offset : offset + ps.chunk * ps.row_numel].view(ps.chunk, *ps.shape[1:])
                block[:rows].copy_(local)  # the cast to the rollout dtype happens here, on the shard
                block[rows:].zero_()
                offset += ps.chunk * ps.row_numel
            out = torch.empty(spec.gathered_numel, dtype=self.dtype, device=self.device)
            _all_gather(out, send, group=group)
            del send
            nbytes = out.numel() * out.element_size()
            stats.units += 1
            stats.gathered_bytes += nbytes * (spec.world - 1) // spec.world
            stats.peak_unit_bytes = max(stats.peak_unit_bytes, nbytes)
            yield spec, out
            del out
        stats.seconds = time.perf_counter() - t0

    def _full_tensor_units(self, stats: StreamStats) -> Iterator[tuple[UnitSpec, torch.Tensor]]:
        """The TP path: each parameter cast on its shard, gathered whole with ``full_tensor()``, packed per unit."""
        for spec, (_, params) in zip(self.manifest.units, self._units):
            out = torch.empty(spec.gathered_numel, dtype=self.dtype, device=self.device)
            offset = 0
            for ps, (_, p) in zip(spec.params, params):
                assert isinstance(p, DTensor), f"{ps.name}: the weight stream reads DTensor parameters"
                full = p.detach().to(self.dtype).full_tensor()
                n = full.numel()
                out[offset : offset + n].view(ps.shape).copy_(full)
                offset += n
                ranks = p.device_mesh.size()
                stats.gathered_bytes += n * full.element_size() * (ranks - 1) // ranks
                del full
            nbytes = out.numel() * out.element_size()
            stats.units += 1
            stats.peak_unit_bytes = max(stats.peak_unit_bytes, nbytes)
            yield spec, out
            del out

    def stats(self) -> dict[str, float]:
        return {"weight_sync/gathered_bytes": float(self.last.gathered_bytes)}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec, buf in self.gathered_units():
            for name, tensor in self.manifest.hand_out(spec, buf):
                self.last.tensor_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor
            del buf  # before the next unit is gathered: one unit alive at a time


def unpack_unit(spec: UnitSpec, gathered: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Cut a unit's full tensors out of its gathered buffer, one at a time (each a fresh tensor, except with a
    single rank, where it is a view)."""
    per_rank = spec.numel_per_rank
    offset = 0
    for ps in spec.params:
        size = ps.chunk * ps.row_numel
        if spec.world == 1:
            full = gathered[offset : offset + math.prod(ps.shape)].view(ps.shape)
        else:
            pieces = [
                gathered[r * per_rank + offset : r * per_rank + offset + ps.rows(r) * ps.row_numel]
                for r in range(spec.world)
                if ps.rows(r)
            ]
            full = torch.cat(pieces).view(ps.shape)
        offset += size
        yield ps.name, full
