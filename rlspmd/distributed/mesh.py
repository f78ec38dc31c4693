"""The one object that owns topology: which ranks host which role, and each role's named mesh dims.

Nobody else calls ``DeviceMesh``/``init_device_mesh`` or creates process groups. Roles are ``actor``, ``rollout``,
``ref``, ``critic`` and ``reward``. Colocated placement (the default) puts every role on the whole world; split
placement gives roles their own rank ranges (``actor: 0-5, rollout: 6-7``). Each role mesh is 2-D with
dims ``(dp, tp)``; training roles use ``tp = 1`` there (their data is per rank; their engines' own tensor
parallelism is ``train_mesh``, below), the rollout may use ``tp > 1`` for
engines that shard weights (vLLM), with consecutive ranks forming a TP group.

Roles with the same rank set and dims share one ``DeviceMesh`` (and its process groups).

**Tensor parallelism of the training roles** (``mesh.actor_tp``) does not change how data is dispatched: the trainer
still hands every actor rank its own samples over the role's flat DP mesh (``get("actor", DP)``, all its ranks), as
it does for megatron. The FSDP engine gets a second, 2-D ``(dp, tp)`` mesh over the same ranks (``train_mesh``;
``tp`` fastest, so a TP group is consecutive ranks): tensor parallelism over ``tp``, FSDP2 over ``dp``, and a TP
group runs its members' micro-batches together (``distributed/tp_batch.py``).

**Expert parallelism** (``mesh.actor_ep``) is another engine layout over the actor's ranks: a 2-D ``(edp, ep)`` mesh
(``expert_mesh``; ``ep`` fastest, so an EP group is consecutive ranks). A mixture-of-experts layer's experts are
sharded over ``ep`` and FSDP2-sharded over ``edp`` (the ranks holding the same experts); the dense parameters stay
FSDP2-sharded over the role's flat DP mesh, and data stays per rank (tokens reach their experts by ``all_to_all``
inside the layer, ``models/moe.py``). Only the actor and its reference are expert-parallel (``EXPERT_PARALLEL``).

**Sequence parallelism** (``mesh.actor_sp``) splits each packed micro-batch's tokens of the actor, reference and critic
over an SP group (``sequence_mesh``): the actor's ranks laid out as ``(dp, sp, tp)``, ``tp`` fastest, so the members
of a TP group sit at the same place of their SP groups. Data stays per rank (the group runs its members' micro-batches,
``distributed/sequence_parallel.py``) and FSDP2 still shards over all the role's ranks.

The RL config (``MeshConfig``) places the actor and the rollout; ``ref``, ``critic`` and ``reward`` follow the actor
(``ParallelDims`` itself accepts any placement). When the actor and the rollout sit on disjoint ranks (split
placement), two 1-D *link* meshes connect them: one over both rank sets (prompts, samples and control move on it)
and one over the actor's first rank plus the rollout ranks (weights are broadcast on it). See ``link``.

**Model-parallel groups of an engine** (``model_parallel_groups``): the megatron engine lays a role's ranks out as a
(pp, dp, tp) grid of its own (``actor.engine.tp``/``pp`` of a Megatron engine, per role, known only when the engine
is built). Its groups are made here over the role's ranks with ``new_group`` and local synchronisation (only the
role's ranks take part, so a split placement's rollout ranks need not follow), cached per rank set. They are not
``DeviceMesh`` sub-meshes: a ``DeviceMesh`` is created collectively by the whole world (the rollout-only ranks of a
split placement never build an engine), and the groups megatron needs include two no mesh dim gives (the first and
last stage of a pipeline, for tied embeddings; this rank alone, for context parallelism 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class MeshConfig:
    actor_ranks: str = "all"
    """Global ranks hosting the actor: ``all``, ``0-3`` or ``0,1,2``. Colocated (everything on ``all``) is the default.
    Must include rank 0 (it reads the data and logs)."""
    rollout_ranks: str = "all"
    """Global ranks hosting the rollout engine: the actor's ranks (colocated, the hybrid engine) or ranks disjoint
    from them (split placement: prompts, samples and weights move between the two meshes with collectives). The
    reference, critic and reward model always live on the actor's ranks."""
    rollout_tp: int = 1
    """Tensor-parallel degree of the rollout engine (consecutive ranks form a TP group)."""
    actor_tp: int = 1
    """Tensor-parallel degree of the FSDP engine's training roles (actor, reference, critic, on the actor's ranks): the
    actor's ranks form a 2-D ``(dp, tp)`` mesh, consecutive ranks a TP group; attention heads and MLP columns/rows are
    sharded over ``tp`` (``torch.distributed.tensor.parallel``), FSDP2 shards over ``dp``. Data stays per rank: a TP
    group runs its members' micro-batches together. Must divide the actor's ranks and the model's attention and KV
    heads; the FSDP engine only (megatron has ``actor.engine.tp``), no ``actor.lora``, and the native rollout
    then keeps its own copy of the weights (synced through the weight stream) instead of reading them in place."""
    actor_ep: int = 1
    """Expert-parallel degree of a mixture-of-experts actor and its reference (FSDP engine): consecutive groups of
    ``actor_ep`` ranks split each MoE layer's experts between them (``E / actor_ep`` each) and send every token to
    its experts' rank with ``all_to_all``; dense parameters stay FSDP2-sharded over all the actor's ranks. Must
    divide the actor's ranks and the model's experts; not with ``actor_tp`` > 1 or ``actor.lora``; the native
    rollout then keeps its own copy of the weights (docs/moe.md)."""
    actor_sp: int = 1
    """Sequence-parallel degree of the FSDP engine's training roles (actor, reference, critic): groups of ``actor_sp``
    ranks (consecutive ones; every ``actor_tp``-th one with tensor parallelism) split every packed micro-batch's tokens
    between them, so a response is no longer bounded by one rank's memory. Data stays per rank: the group runs its
    members' micro-batches one after the other (training) or together (no-grad passes), each rank computing its slice
    of the sequence. Attention sees the whole sequence through ``actor_sp_mode``. Needs ``model.packing``; not with
    ``actor_ep`` > 1, a MoE or a vision-language model (docs/sequence-parallel.md)."""
    actor_sp_mode: Literal["auto", "ulysses", "allgather"] = "auto"
    """How attention sees the whole sequence under ``actor_sp``: ``ulysses`` (an all-to-all trades the sequence split
    for a head split around attention; the attention heads must divide by ``actor_tp * actor_sp``), ``allgather``
    (each rank keeps its queries and all-gathers the keys and values: any head count), ``auto`` (ulysses where the
    heads allow it, else allgather)."""


ROLES = ("actor", "rollout", "ref", "critic", "reward")
FOLLOWERS = ("ref", "critic", "reward")  # the RL config places them on the actor's ranks
TRAINED = ("actor", "ref", "critic")  # the roles whose FSDP engine ``mesh.actor_tp`` tensor-parallelises
EXPERT_PARALLEL = ("actor", "ref")  # the roles whose FSDP engine ``mesh.actor_ep`` expert-parallelises
SEQUENCE_PARALLEL = TRAINED  # the roles whose FSDP engine ``mesh.actor_sp`` splits sequences for (not the reward model)
DP = "dp"
TP = "tp"
EP = "ep"
EDP = "edp"
SP = "sp"
SDP = "sdp"
LINK = "link"


def parse_ranks(spec: str, world_size: int, *, field_name: str) -> list[int]:
    """``all`` | ``a-b`` (inclusive) | ``a,b,c`` | a mix (``0-3,6``) -> sorted global ranks."""
    spec = spec.strip()
    if spec == "all":
        return list(range(world_size))
    ranks: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-"))
                ranks.extend(range(lo, hi + 1))
            else:
                ranks.append(int(part))
    except ValueError:
        raise ValueError(f"{field_name}={spec!r}: expected 'all', 'a-b' or 'a,b,c'") from None
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"{field_name}={spec!r}: empty or repeated ranks")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"{field_name}={spec!r}: ranks {bad} outside the world of {world_size} ranks")
    return sorted(ranks)


@dataclass
class ParallelDims:
    """Validated placement: role -> global ranks and tensor-parallel degree."""

    world_size: int
    role_ranks: dict[str, list[int]]
    role_tp: dict[str, int] = field(default_factory=dict)
    train_tp: int = 1
    """Tensor-parallel degree of the training engines of ``TRAINED`` roles (``mesh.actor_tp``); not a data dim."""
    train_ep: int = 1
    """Expert-parallel degree of the ``EXPERT_PARALLEL`` roles' engines (``mesh.actor_ep``); not a data dim."""
    train_sp: int = 1
    """Sequence-parallel degree of the ``SEQUENCE_PARALLEL`` roles' engines (``mesh.actor_sp``); not a data dim."""

    def __post_init__(self):
        for role in ROLES:
            if role not in self.role_ranks:
                raise ValueError(f"no placement for role {role!r}")
            tp = self.role_tp.setdefault(role, 1)
            n = len(self.role_ranks[role])
            if tp < 1 or n % tp:
                raise ValueError(
                    f"mesh: {role} tensor-parallel degree {tp} does not divide its {n} ranks "
                    f"(world size {self.world_size})"
                )
        n = len(self.role_ranks["actor"])
        if self.train_tp < 1 or n % self.train_tp:
            raise ValueError(
                f"mesh.actor_tp={self.train_tp} must be a positive divisor of the actor's {n} ranks "
                f"(mesh.actor_ranks); consecutive ranks form a tensor-parallel group"
            )
        for role in TRAINED:
            if self.train_tp > 1 and self.role_ranks[role] != self.role_ranks["actor"]:
                raise ValueError(f"mesh.actor_tp={self.train_tp}: the {role} must live on the actor's ranks")
        if self.train_ep < 1 or n % self.train_ep:
            raise ValueError(
                f"mesh.actor_ep={self.train_ep} must be a positive divisor of the actor's {n} ranks "
                f"(mesh.actor_ranks); consecutive ranks form an expert-parallel group"
            )
        if self.train_ep > 1 and self.train_tp > 1:
            raise ValueError(
                f"mesh.actor_ep={self.train_ep} and mesh.actor_tp={self.train_tp}: expert and tensor parallelism do "
                "not combine yet; use one of them"
            )
        for role in EXPERT_PARALLEL:
            if self.train_ep > 1 and self.role_ranks[role] != self.role_ranks["actor"]:
                raise ValueError(f"mesh.actor_ep={self.train_ep}: the {role} must live on the actor's ranks")
        if self.train_sp < 1 or n % (self.train_sp * self.train_tp):
            raise ValueError(
                f"mesh.actor_sp={self.train_sp} (times mesh.actor_tp={self.train_tp}) must divide the actor's {n} "
                f"ranks (mesh.actor_ranks); a sequence-parallel group is every actor_tp-th rank of "
                f"{self.train_sp * self.train_tp} consecutive ones"
            )
        if self.train_sp > 1 and self.train_ep > 1:
            raise ValueError(
                f"mesh.actor_sp={self.train_sp} and mesh.actor_ep={self.train_ep}: sequence and expert parallelism do "
                "not combine; use one of them"
            )
        for role in SEQUENCE_PARALLEL:
            if self.train_sp > 1 and self.role_ranks[role] != self.role_ranks["actor"]:
                raise ValueError(f"mesh.actor_sp={self.train_sp}: the {role} must live on the actor's ranks")

    @classmethod
    def from_config(cls, cfg: MeshConfig, world_size: int) -> "ParallelDims":
        """The RL placements: the actor and the rollout where the config says; ``FOLLOWERS`` on the actor's ranks."""
        actor = parse_ranks(cfg.actor_ranks, world_size, field_name="mesh.actor_ranks")
        ranks = {"actor": actor, "rollout": parse_ranks(cfg.rollout_ranks, world_size, field_name="mesh.rollout_ranks")}
        ranks.update({role: list(actor) for role in FOLLOWERS})
        return cls(
            world_size=world_size,
            role_ranks=ranks,
            role_tp={"rollout": cfg.rollout_tp},
            train_tp=cfg.actor_tp,
            train_ep=cfg.actor_ep,
            train_sp=cfg.actor_sp,
        )

    def dp_size(self, role: str) -> int:
        return len(self.role_ranks[role]) // self.role_tp[role]

    def colocated(self, a: str, b: str) -> bool:
        return self.role_ranks[a] == self.role_ranks[b]

    @property
    def is_colocated(self) -> bool:
        return all(self.role_ranks[r] == self.role_ranks["actor"] for r in ROLES)

    def disjoint(self, a: str, b: str) -> bool:
        return not set(self.role_ranks[a]) & set(self.role_ranks[b])

    def layout(self) -> str:
        lines = [f"world size {self.world_size}, placement {'colocated' if self.is_colocated else 'split'}"]
        for role in ROLES:
            ranks = self.role_ranks[role]
            train = (
                f" (engine: dp={len(ranks) // self.train_tp} x tp={self.train_tp})"
                if role in TRAINED and self.train_tp > 1
                else ""
            )
            if role in EXPERT_PARALLEL and self.train_ep > 1:
                train = f" (experts: edp={len(ranks) // self.train_ep} x ep={self.train_ep})"
            if role in SEQUENCE_PARALLEL and self.train_sp > 1:
                train += f" (sequences split over sp={self.train_sp})"
            lines.append(f"  {role:8s} ranks {_fmt(ranks):12s} dp={self.dp_size(role)} tp={self.role_tp[role]}{train}")
        return "\n".join(lines)


def _fmt(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))


class RoleMeshes:
    """Builds one ``DeviceMesh`` per distinct (ranks, tp) and hands out role meshes by name.

    Construction is collective: every rank creates every mesh (process-group creation needs all ranks),
    and ``get`` returns None on ranks that do not host the role.
    """

    def __init__(self, dims: ParallelDims, device_type: str, rank: int):
        self.dims = dims
        self.rank = rank
        built: dict[tuple, DeviceMesh] = {}
        self._meshes: dict[str, DeviceMesh] = {}
        for role in ROLES:
            ranks, tp = dims.role_ranks[role], dims.role_tp[role]
            key = (tuple(ranks), tp)
            if key not in built:
                layout = torch.tensor(ranks, dtype=torch.int).reshape(len(ranks) // tp, tp)
                built[key] = DeviceMesh(device_type, layout, mesh_dim_names=(DP, TP))
            self._meshes[role] = built[key]
        # The training engines' 2-D (dp, tp) mesh (mesh.actor_tp > 1), over the actor's ranks, tp fastest.
        self._train: DeviceMesh | None = None
        if dims.train_tp > 1:
            ranks = dims.role_ranks["actor"]
            layout = torch.tensor(ranks, dtype=torch.int).reshape(len(ranks) // dims.train_tp, dims.train_tp)
            self._train = DeviceMesh(device_type, layout, mesh_dim_names=(DP, TP))
        # The expert-parallel (edp, ep) mesh (mesh.actor_ep > 1), over the actor's ranks, ep fastest.
        self._experts: DeviceMesh | None = None
        if dims.train_ep > 1:
            ranks = dims.role_ranks["actor"]
            layout = torch.tensor(ranks, dtype=torch.int).reshape(len(ranks) // dims.train_ep, dims.train_ep)
            self._experts = DeviceMesh(device_type, layout, mesh_dim_names=(EDP, EP))
        # The sequence-parallel groups (mesh.actor_sp > 1): the actor's ranks as (dp, sp, tp), tp fastest, so that a
        # TP group's members sit at the same place of their SP groups; viewed as (sdp, sp) with sdp = (dp, tp).
        self._sequence: DeviceMesh | None = None
        if dims.train_sp > 1:
            ranks = dims.role_ranks["actor"]
            sp, tp = dims.train_sp, dims.train_tp
            grid = torch.tensor(ranks, dtype=torch.int).reshape(len(ranks) // (sp * tp), sp, tp)
            layout = grid.transpose(1, 2).reshape(-1, sp)
            self._sequence = DeviceMesh(device_type, layout, mesh_dim_names=(SDP, SP))
        # Split placement: the actor <-> rollout links (every rank takes part in creating their groups).
        self._links: dict[tuple[str, str, bool], DeviceMesh] = {}
        if dims.disjoint("actor", "rollout"):
            actor, rollout = dims.role_ranks["actor"], dims.role_ranks["rollout"]
            for first_only, ranks in ((False, actor + rollout), (True, [actor[0], *rollout])):
                layout = torch.tensor(sorted(ranks), dtype=torch.int)
                self._links[("actor", "rollout", first_only)] = DeviceMesh(device_type, layout, mesh_dim_names=(LINK,))

    def hosts(self, role: str) -> bool:
        return self.rank in self.dims.role_ranks[role]

    def get(self, role: str, dim: str | None = None) -> DeviceMesh | None:
        """The role's 2-D mesh, or one named dim of it; None when this rank does not host the role."""
        if role not in self._meshes:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        if dim not in (None, DP, TP):
            raise ValueError(f"unknown mesh dim {dim!r}; dims are ({DP!r}, {TP!r})")
        if not self.hosts(role):
            return None
        mesh = self._meshes[role]
        return mesh if dim is None else mesh[dim]

    def train_mesh(self, role: str) -> DeviceMesh | None:
        """The 2-D ``(dp, tp)`` mesh a training role's FSDP engine parallelises over (``mesh.actor_tp`` > 1); None with
        ``actor_tp`` 1 (the engine shards over the role's DP mesh), for other roles, and on ranks without the role."""
        if role not in self._meshes:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        return self._train if role in TRAINED and self.hosts(role) else None

    def expert_mesh(self, role: str) -> DeviceMesh | None:
        """The 2-D ``(edp, ep)`` mesh an expert-parallel role's FSDP engine shards its experts over (``mesh.actor_ep``
        > 1); None with ``actor_ep`` 1, for roles outside ``EXPERT_PARALLEL``, and on ranks without the role."""
        if role not in self._meshes:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        return self._experts if role in EXPERT_PARALLEL and self.hosts(role) else None

    def sequence_mesh(self, role: str) -> DeviceMesh | None:
        """The 1-D mesh of this rank's sequence-parallel group (``mesh.actor_sp`` > 1; group rank = place in the
        sequence); None with ``actor_sp`` 1, for roles outside ``SEQUENCE_PARALLEL``, and on ranks without the role."""
        if role not in self._meshes:
            raise ValueError(f"unknown role {role!r}; roles are {ROLES}")
        if self._sequence is None or role not in SEQUENCE_PARALLEL or not self.hosts(role):
            return None
        return self._sequence[SP]

    def dp_rank(self, role: str) -> int | None:
        mesh = self.get(role, DP)
        return None if mesh is None else mesh.get_local_rank()

    def link(self, src: str, dst: str, *, first_only: bool = False) -> DeviceMesh | None:
        """1-D mesh joining two disjoint roles, over sorted global ranks: all ranks of both, or (``first_only``)
        the first rank of ``src`` plus the ranks of ``dst``. None on ranks outside it.

        Only the actor -> rollout link exists (split placement); anything else is a ValueError.
        """
        key = (src, dst, first_only)
        if key not in self._links:
            raise ValueError(f"no link mesh {src} -> {dst}: it exists only when they sit on disjoint ranks")
        mesh = self._links[key]
        return mesh if self.rank in mesh.mesh.tolist() else None


# -- an engine's model-parallel groups ---------------------------------------------------------------------------------


def grid_coords(index: int, *, tp: int, dp: int) -> tuple[int, int, int]:
    """``(pp_rank, dp_rank, tp_rank)`` of the ``index``-th rank of a role (tp fastest, then dp, then pp)."""
    return index // (tp * dp), (index // tp) % dp, index % tp


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def process_group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group over ``ranks``, created once per process (group names are hashed from the ranks, so a second
    ``new_group`` over the same ranks would collide). Only the member ranks take part in creating it."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _GROUPS[key]


@dataclass
class ModelParallelGroups:
    """This rank's place in a role's (pp, dp, tp) grid and the process groups built over the role's ranks."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    """This rank alone (megatron's modules read a context-parallel group; context parallelism is 1)."""
    mp_group: dist.ProcessGroup
    """The model-parallel group: the ``tp x pp`` ranks of this DP replica, which run each micro-batch together (the
    tp group when ``pp`` is 1). Group rank ``pp_rank * tp + tp_rank``."""
    embd_group: dist.ProcessGroup | None
    """First and last stage of this rank's pipeline when asked for (``pipeline_ends``: tied embeddings on both) and
    ``pp`` > 1, on those two stages; else None."""
    pp_ranks: list[int]
    """Global ranks of this rank's pipeline, stage order."""
    tp_mesh: DeviceMesh | None
    """1-D mesh over the TP group (checkpoint DTensors); None when ``tp`` is 1."""

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def model_parallel_groups(
    mesh: DeviceMesh, *, tp: int, pp: int, field_prefix: str, pipeline_ends: bool = False
) -> ModelParallelGroups:
    """The (pp, dp, tp) groups over the ranks of a role's ``mesh`` (tp fastest: megatron's order), collective over
    those ranks only. ``pipeline_ends`` also builds the first/last-stage group (tied embeddings, ``pp`` > 1);
    ``field_prefix`` (``actor.engine``) names the config fields in errors."""
    ranks = mesh.mesh.flatten().tolist()
    n = len(ranks)
    if tp < 1 or pp < 1 or n % (tp * pp):
        raise ValueError(f"{field_prefix}.tp={tp} x {field_prefix}.pp={pp} does not divide the role's {n} ranks")
    dp = n // (tp * pp)
    me = ranks.index(dist.get_rank())
    pp_rank, dp_rank, tp_rank = grid_coords(me, tp=tp, dp=dp)
    coords = [grid_coords(i, tp=tp, dp=dp) for i in range(n)]
    tp_ranks = [r for r, c in zip(ranks, coords) if c[0] == pp_rank and c[1] == dp_rank]
    pp_ranks = [r for r, c in zip(ranks, coords) if c[1] == dp_rank and c[2] == tp_rank]
    dp_ranks = [r for r, c in zip(ranks, coords) if c[0] == pp_rank and c[2] == tp_rank]
    mp_ranks = [r for r, c in zip(ranks, coords) if c[1] == dp_rank]  # (pp, tp) order
    device_type = mesh.device_type
    tp_group = process_group(tp_ranks)
    in_ends = pipeline_ends and pp > 1 and pp_rank in (0, pp - 1)
    return ModelParallelGroups(
        tp=tp,
        pp=pp,
        dp=dp,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        tp_group=tp_group,
        pp_group=process_group(pp_ranks),
        dp_group=process_group(dp_ranks),
        cp_group=process_group([dist.get_rank()]),
        mp_group=process_group(mp_ranks),
        embd_group=process_group([pp_ranks[0], pp_ranks[-1]]) if in_ends else None,
        pp_ranks=pp_ranks,
        tp_mesh=DeviceMesh.from_group(tp_group, device_type) if tp > 1 else None,
    )
