"""The megatron-core training engine: the FSDP engine's surface over a megatron ``GPTModel`` with tensor and pipeline
parallelism.

``build_megatron_engine`` loads an HF Qwen2/Llama directory into a megatron model (``rlspmd.models.megatron_convert``
converts the weights; every megatron call is in ``third_party/megatron_adapter.py``, imported here lazily, so rlspmd
runs without megatron-core). The engine offers what the roles use from ``FSDPEngine``: ``mesh``, ``device``,
``module`` (the role's forward: log-probs/entropy for a policy, values for a critic), ``optimizer_step``, ``lr``,
``state_dict``/``load_state_dict`` (DCP), ``param_shapes``, ``full_state_dict``, and ``weight_stream`` for the rollout.

**Layout.** The role's ranks (its mesh, as the trainer builds it) form a (pp, dp, tp) grid, tp fastest (megatron's
``tp-cp-ep-dp-pp`` order): the tensor-parallel groups are consecutive ranks. The groups are created here from
those ranks (``new_group`` with local synchronisation: only the role's ranks take part), never with
``parallel_state.initialize_model_parallel``, which would carve the whole world into one global layout. Pipeline
stage ``p`` holds layers ``[p L/pp, (p+1) L/pp)``, the embedding on the first stage, the final norm and head on the
last; with tied embeddings the last stage keeps a copy of the embedding (megatron's ``output_layer``), loaded from
the same HF tensor, its gradient summed with the first stage's before each step (``embd_group``).

**Data.** The trainer hands every rank its own samples, exactly as with FSDP (it need not know about TP or PP). A
forward gathers the micro-batches of the model-parallel group (the tp x pp ranks of a replica; same count on every
rank: ``split_micro_batches`` agrees it over the mesh), runs them as one batch through the stages, and each rank
gets its own rows' outputs. Under autograd the outputs carry a hook that sums their gradient over the TP group, so
every TP rank back-propagates the same total loss (the sum of its members' losses) — what tensor parallelism needs.
Gradients are then summed (not averaged) over the DP group: losses are already normalised by the global batch
(``rlspmd.algorithms.aggregation``), as in the FSDP engine.

**Pipeline.** An update goes through megatron's forward-backward contract: ``forward_step`` runs the stage and, on
the last stage, a loss function that calls ``loss_fn`` for each pipeline member's micro-batch (gathered to the last
stage beforehand) and sums them. CUDA runs megatron's 1F1B schedule; CPU a GPipe schedule over Gloo
(``rlspmd.engines.pipeline``: megatron's p2p code allocates on CUDA). A no-grad module call (log-probs, values) passes
the hidden states stage to stage and the last stage broadcasts every member's outputs down its pipeline.

**Forward.** Each row's valid tokens are moved to the front (positions 0..n-1, which is what rlspmd's
``position_ids_BL`` hold, so RoPE sees the same positions as the HF model), padded at the end and masked (causal
+ key padding). The model returns hidden states; the LM head runs in ``chunked_logprobs`` with the full vocabulary
(the TP shards of the head are gathered, once per forward).

Checkpoints hold the weights and AdamW state under the *Hugging Face* names of the FSDP engine's root module
(``hf.model.layers.0.self_attn.q_proj.weight``, ...), each TP shard a ``DTensor`` piece of the HF tensor: DCP
reshards between TP degrees, and ``scripts/export_hf.py`` reads a megatron checkpoint as it reads an FSDP one.

Checkpoints and the weight stream with pipeline stages: each stage saves its own tensors (the tied embedding's two
copies under one name, identical); every rank streams every HF tensor, each unit broadcast from its stage.

Simplifications (each a ``ValueError`` where a user could ask for it): no interleaved (virtual) pipeline stages, no
sequence/context/expert parallelism, no activation recomputation, no distributed optimiser (AdamW on each rank's
shard, replicated over DP), no packed (THD) sequences: a micro-batch runs padded to its longest row. The LM head is
computed with the full vocabulary on every TP rank (no vocab-parallel cross entropy). The CPU pipeline schedule does
not overlap stages (GPipe with blocking sends): it exists to run and test the engine on CPU.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rlspmd.config import MegatronConfig, OptimConfig
from rlspmd.distributed.tp_batch import all_gather_varlen, keep_own_rows
from rlspmd.engines.fsdp import lr_lambda
from rlspmd.models import megatron_convert as mc
from rlspmd.models.loader import DTYPES, check_model_dir
from rlspmd.models.logprobs import DEFAULT_CHUNK, chunked_logprobs
from rlspmd.models.value import value_head
from rlspmd.distributed.micro_batches import zero_weight_copy
from rlspmd.engines.base import UpdateStats
from rlspmd.engines.pipeline import StageP2P
from rlspmd.engines.weight_stream import ParamSpec, StreamStats, UnitSpec, WeightManifest, unpack_unit

ModuleKind = Literal["policy", "value"]


# -- topology -----------------------------------------------------------------------------------------------------


def grid_coords(index: int, *, tp: int, dp: int) -> tuple[int, int, int]:
    """``(pp_rank, dp_rank, tp_rank)`` of the ``index``-th rank of a role (tp fastest, then dp, then pp)."""
    return index // (tp * dp), (index // tp) % dp, index % tp


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _group(ranks: list[int]) -> dist.ProcessGroup:
    """A process group over ``ranks``, created once per process (group names are hashed from the ranks, so a second
    ``new_group`` over the same ranks would collide). Only the member ranks take part in creating it."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _GROUPS[key]


@dataclass
class MegatronGroups:
    """This rank's place in the role's (pp, dp, tp) grid and the process groups built over the role's ranks."""

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
    """First and last stage of this rank's pipeline when it holds tied embeddings on both (``pp`` > 1), else None."""
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


def build_groups(mesh: DeviceMesh, *, tp: int, pp: int, field_prefix: str, tied: bool = False) -> MegatronGroups:
    """The role's groups: ``tied`` also builds the first/last-stage group of tied embeddings (pp > 1)."""
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
    tp_group = _group(tp_ranks)
    in_embd = tied and pp > 1 and pp_rank in (0, pp - 1)
    return MegatronGroups(
        tp=tp, pp=pp, dp=dp, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
        tp_group=tp_group, pp_group=_group(pp_ranks), dp_group=_group(dp_ranks), cp_group=_group([dist.get_rank()]),
        mp_group=_group(mp_ranks), embd_group=_group([pp_ranks[0], pp_ranks[-1]]) if in_embd else None,
        pp_ranks=pp_ranks, tp_mesh=DeviceMesh.from_group(tp_group, device_type) if tp > 1 else None,
    )


# -- autograd pieces for tensor parallelism (the output-gradient sum is distributed/tp_batch.py's) -----------------


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, *, group) -> None:
    """One flat all-gather (``all_gather_single`` from torch 2.13 on, ``all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class _GatherRows(torch.autograd.Function):
    """All-gather dim-0 shards over ``group`` (forward); the backward keeps this rank's rows of the gradient, which is
    right when every rank computes the same function of the gathered tensor (the head over the group's rows)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        _all_gather_flat(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows : (rank + 1) * ctx.rows], None


# -- the padded layout megatron runs --------------------------------------------------------------------------------


@dataclass
class FrontPacked:
    """A micro-batch with each row's valid tokens moved to the front: ``ids_BW`` (W = the longest row, 0 after the
    end), ``lengths_B``, and for the response columns their index in that layout (``resp_pos_BR``) and validity."""

    ids_BW: torch.Tensor
    lengths_B: torch.Tensor
    resp_pos_BR: torch.Tensor
    resp_valid_BR: torch.Tensor


def front_pack(input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, response_len: int) -> FrontPacked:
    """Move each row's valid tokens (``attention_mask_BL``) to the front, in order. A token's index in the result is
    its position id (``cumsum(mask) - 1``, rlspmd's ``position_ids_BL``), so RoPE over the row indices is exact."""
    valid = attention_mask_BL.bool()
    lengths = valid.sum(-1)
    order = torch.argsort((~valid).long(), dim=1, stable=True)  # valid tokens first, order kept
    W = max(int(lengths.max()), 1)
    ids = input_ids_BL.gather(1, order)[:, :W]
    ids = ids.masked_fill(torch.arange(W, device=ids.device)[None] >= lengths[:, None], 0)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    return FrontPacked(ids, lengths, pos[:, -response_len:], valid[:, -response_len:])


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def gather_front_packed(fp: FrontPacked, group: dist.ProcessGroup) -> list[FrontPacked]:
    """Every member's ``FrontPacked`` (in group-rank order), with two all-gathers: shapes, then one padded buffer."""
    return [FrontPacked(*m) for m in all_gather_varlen([fp.ids_BW, fp.lengths_B, fp.resp_pos_BR, fp.resp_valid_BR], group)]


Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
"""``head(hidden_NH, targets_N)``: the per-token outputs (log-probs and entropy, or values) of selected positions."""


@dataclass
class GroupRows:
    """One micro-batch of the whole model-parallel group as every stage runs it: the members' rows (``FrontPacked``,
    in mp-group order) concatenated and padded to the longest, with the causal + key-padding mask megatron reads."""

    members: list[FrontPacked]
    ids_NW: torch.Tensor
    offsets: list[int]
    """Row offset of each member in ``ids_NW``."""
    mask_N1WW: torch.Tensor
    """True where attention is not allowed (megatron's convention)."""

    @classmethod
    def of(cls, members: list[FrontPacked]) -> "GroupRows":
        W = max(m.ids_BW.shape[1] for m in members)
        ids = torch.cat([_pad_cols(m.ids_BW, W) for m in members])
        lengths = torch.cat([m.lengths_B for m in members])
        cols = torch.arange(W, device=ids.device)
        allowed = (cols[None, :] <= cols[:, None])[None] & (cols[None, None, :] < lengths[:, None, None])
        offsets = [0]
        for m in members[:-1]:
            offsets.append(offsets[-1] + m.ids_BW.shape[0])
        return cls(members, ids, offsets, ~allowed[:, None])

    @property
    def hidden_shape(self) -> tuple[int, int]:
        """``(W, N)``: the leading dims of the hidden states passed between stages."""
        return self.ids_NW.shape[1], self.ids_NW.shape[0]


def stage_forward(engine: "MegatronEngine", rows: GroupRows) -> torch.Tensor:
    """This stage's layers over ``rows``: from the token ids on the first stage, else from the input tensor the
    schedule set (``model.set_input_tensor``). Returns ``(W, N, hidden)`` (after the final norm on the last stage)."""
    W, N = rows.hidden_shape
    cols = torch.arange(W, device=rows.ids_NW.device)
    with engine.autocast():
        hidden_WNH = engine.model(rows.ids_NW, cols.expand(N, W), rows.mask_N1WW)
    assert hidden_WNH.shape == (W, N, engine.arch.hidden_size), f"expected hidden states, got {tuple(hidden_WNH.shape)}"
    return hidden_WNH


def member_outputs(engine: "MegatronEngine", hidden_WNH: torch.Tensor, rows: GroupRows, tp_members: list[FrontPacked],
                   *, pp_index: int, head: Head) -> tuple[torch.Tensor, ...]:
    """``head`` on the hidden states that predict response tokens, for the rows of pipeline member ``pp_index``'s TP
    group (``tp_members``, with their response columns); returns this TP rank's member's ``(B, R)`` outputs. Under
    autograd the group's outputs carry ``SumGradOverGroup`` (``keep_own_rows`` over the member's token counts): every
    TP rank back-propagates the group's total loss."""
    g, hidden = engine.groups, hidden_WNH.transpose(0, 1)
    # Response token at index p is predicted by the hidden state at p - 1 (a prompt token comes first).
    sel, pos, counts = [], [], []
    for t, m in enumerate(tp_members):
        r, c = m.resp_valid_BR.nonzero(as_tuple=True)
        sel.append(r + rows.offsets[pp_index * g.tp + t])
        pos.append(m.resp_pos_BR[r, c])
        counts.append(len(r))
    sel, pos = torch.cat(sel), torch.cat(pos)
    with engine.autocast():
        outs = head(hidden[sel, pos - 1], rows.ids_NW[sel, pos])
    valid = tp_members[g.tp_rank].resp_valid_BR
    result = []
    for out_N in outs:
        own = (keep_own_rows(out_N, counts, g.tp_group) if g.tp > 1 else out_N).float()
        result.append(own.new_zeros(valid.shape).masked_scatter(valid, own))
    return tuple(result)


class _MegatronModule:
    """The shared forward of the policy and value modules (``head`` and ``n_out`` say what they compute).

    A call is collective over the model-parallel group: the group's rows run through the model together and each
    rank gets its own rows' outputs. With pipeline stages (no autograd: training goes through ``optimizer_step``)
    the hidden states pass stage to stage and the last stage broadcasts every member's outputs down its pipeline."""

    n_out: int

    def __init__(self, engine: "MegatronEngine"):
        self.engine = engine

    def head(self, **kw) -> Head:
        raise NotImplementedError

    def wrap(self, outs: tuple[torch.Tensor, ...]):
        raise NotImplementedError

    def __call__(self, input_ids_BL, attention_mask_BL, position_ids_BL, *, response_len: int, **kw):
        e, g = self.engine, self.engine.groups
        head = self.head(**kw)
        mine = front_pack(input_ids_BL, attention_mask_BL, response_len)
        members = gather_front_packed(mine, g.mp_group) if g.tp * g.pp > 1 else [mine]
        rows = GroupRows.of(members)
        if g.pp == 1:
            return self.wrap(member_outputs(e, stage_forward(e, rows), rows, members, pp_index=0, head=head))
        if torch.is_grad_enabled():
            raise RuntimeError("with pipeline parallelism the module runs without autograd only (torch.no_grad()); "
                               "training goes through optimizer_step")
        e.model.set_input_tensor(None if g.first_stage else e.p2p.recv_prev())
        hidden = stage_forward(e, rows)
        e.model.set_input_tensor(None)
        if not g.last_stage:
            e.p2p.send_next(hidden)
        # Every member's outputs, stage order, flat: computed on the last stage, broadcast down the pipeline.
        sizes = [self.n_out * members[j * g.tp + g.tp_rank].resp_valid_BR.numel() for j in range(g.pp)]
        if g.last_stage:
            flat = torch.cat([o.flatten() for j in range(g.pp) for o in member_outputs(
                e, hidden, rows, members[j * g.tp : (j + 1) * g.tp], pp_index=j, head=head)])
        else:
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=e.device)
        dist.broadcast(flat, group=g.pp_group, group_src=g.pp - 1)
        shape_BR = mine.resp_valid_BR.shape
        own = flat[sum(sizes[: g.pp_rank]) : sum(sizes[: g.pp_rank + 1])].view(self.n_out, *shape_BR)
        return self.wrap(tuple(own.unbind(0)))


class _LastStageModule:
    """What ``loss_fn`` gets on the last pipeline stage for pipeline member ``pp_index``'s micro-batch: the module's
    signature, computing the head over the hidden states the pipeline produced (the member's rows)."""

    def __init__(self, module: _MegatronModule, hidden_WNH: torch.Tensor, rows: GroupRows, pp_index: int):
        self.module, self.hidden_WNH, self.rows, self.pp_index = module, hidden_WNH, rows, pp_index

    def __call__(self, input_ids_BL, attention_mask_BL, position_ids_BL, *, response_len: int, **kw):
        e, g = self.module.engine, self.module.engine.groups
        mine = front_pack(input_ids_BL, attention_mask_BL, response_len)
        ran = self.rows.members[self.pp_index * g.tp + g.tp_rank].ids_BW
        assert torch.equal(mine.ids_BW, ran), "loss_fn must call the module on its micro-batch's input_ids_BL/attention_mask_BL"
        tp_members = gather_front_packed(mine, g.tp_group) if g.tp > 1 else [mine]
        outs = member_outputs(e, self.hidden_WNH, self.rows, tp_members, pp_index=self.pp_index, head=self.module.head(**kw))
        return self.module.wrap(outs)


class _ZeroOutputs:
    """The module's signature returning zeros: what ``loss_fn`` gets on a stage that only records metric names."""

    def __init__(self, module: _MegatronModule):
        self.module = module

    def __call__(self, input_ids_BL, attention_mask_BL, position_ids_BL, *, response_len: int, **kw):
        zeros = torch.zeros(input_ids_BL.shape[0], response_len, device=input_ids_BL.device)
        return self.module.wrap((zeros,) * self.module.n_out)


class MegatronPolicyModule(_MegatronModule):
    """The policy forward with ``CausalLMPolicy``'s signature: ``module(input_ids_BL, attention_mask_BL,
    position_ids_BL, *, response_len, temperature=1.0, with_entropy=True) -> (logprobs_BR, entropy_BR)``.

    ``position_ids_BL`` is not read: positions follow from the mask (see ``front_pack``)."""

    n_out = 2

    def __init__(self, engine: "MegatronEngine", *, logprob_chunk: int | None = DEFAULT_CHUNK):
        super().__init__(engine)
        self.logprob_chunk = logprob_chunk

    def head(self, *, temperature: float = 1.0, with_entropy: bool = True) -> Head:
        e = self.engine

        def logprobs(hidden_NH, targets_N):
            weight = e.lm_head_weight()
            if e.groups.tp > 1:
                weight = _GatherRows.apply(weight, e.groups.tp_group)
            return chunked_logprobs(hidden_NH, weight, targets_N, temperature=temperature, chunk_size=self.logprob_chunk,
                                    with_entropy=with_entropy)

        return logprobs

    def wrap(self, outs):
        return outs


class MegatronValueModule(_MegatronModule):
    """The critic forward with ``ValueModel``'s signature: ``module(input_ids_BL, attention_mask_BL, position_ids_BL,
    *, response_len) -> values_BR`` (V of the state before each response token)."""

    n_out = 1

    def head(self) -> Head:
        head = self.engine.value_head

        def values(hidden_NH, _targets_N):
            return (torch.matmul(hidden_NH, head.weight[0]) + head.bias[0]).float(),

        return values

    def wrap(self, outs):
        return outs[0]


# -- the engine -----------------------------------------------------------------------------------------------------


def _read_hf_tensors(model_dir: Path) -> Callable[[str], torch.Tensor]:
    """A reader of the directory's safetensors by HF causal-LM name (``model.layers.0...``); a base-model directory
    (no ``model.`` prefix, as ``AutoModel`` saves it) is read under the same names."""
    where: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                where[key] = f
    prefixed = any(k.startswith("model.") for k in where)

    def read(name: str) -> torch.Tensor:
        key = name if prefixed or not name.startswith("model.") else name[len("model."):]
        if key not in where:
            raise ValueError(f"{model_dir}: the safetensors have no tensor {key!r}")
        with safe_open(str(where[key]), framework="pt") as st:
            return st.get_tensor(key)

    return read


class MegatronEngine:
    """A megatron ``GPTModel`` (this rank's TP shard) with, for trained roles, AdamW and its LR schedule.

    Build it with ``build_megatron_engine``. ``kind`` ``policy``: ``module`` returns log-probs and entropy;
    ``value``: a scalar value head on the final hidden states (initialised like ``load_value_model``)."""

    def __init__(self, kind: ModuleKind, model_dir: Path, *, mesh: DeviceMesh, device: torch.device, cfg: MegatronConfig,
                 optim: OptimConfig | None, total_optim_steps: int, dtype: str, seed: int, field_prefix: str):
        from third_party import megatron_adapter as ma  # lazily: megatron-core is optional

        self.ma, self.kind, self.mesh, self.device, self.optim_cfg = ma, kind, mesh, device, optim
        self.model_dir = model_dir
        self._hf_skeleton: nn.Module | None = None
        self.arch = mc.megatron_arch(json.loads((model_dir / "config.json").read_text()), field_name=str(model_dir))
        mc.check_parallel(self.arch, tp=cfg.tp, pp=cfg.pp, field_prefix=field_prefix)
        # A value model never reads the LM head: build it tied, so no output-layer weight is allocated (on a last
        # stage without the embedding megatron allocates one anyway; it is dropped below).
        self.tied = self.arch.tie_embeddings or kind == "value"
        self.groups = g = build_groups(mesh, tp=cfg.tp, pp=cfg.pp, field_prefix=field_prefix,
                                       tied=kind == "policy" and self.arch.tie_embeddings)
        self.compute_dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if cfg.param_dtype == "auto" \
            else DTYPES[cfg.param_dtype]
        self.pipeline_dtype = DTYPES[dtype]
        ma.no_dropout_rng_tracker()
        config = ma.transformer_config(self.arch, tp=g.tp, pp=g.pp, params_dtype=DTYPES[dtype], cpu=device.type == "cpu")
        self.pg_collection = ma.process_groups(tp=g.tp_group, pp=g.pp_group, cp=g.cp_group, dp=g.dp_group, embd=None)
        self.model = ma.gpt_model(config, self.arch, pg_collection=self.pg_collection, pre_process=g.first_stage,
                                  post_process=g.last_stage, tie_embeddings=self.tied, device=device)
        self.p2p = StageP2P(g.pp_group, dtype=self.pipeline_dtype, device=device) if g.pp > 1 else None
        self.layers = mc.stage_layers(self.arch.num_layers, pp=g.pp, pp_rank=g.pp_rank)
        names = mc.stage_names(self.arch, self.layers, first=g.first_stage, last=g.last_stage, with_head=not self.tied)
        if self._has_tied_copy:  # the last stage's copy of the tied embedding (megatron's output_layer)
            names.append("output_layer.weight")
        elif kind == "value" and g.last_stage and not g.first_stage:
            self.model.output_layer.weight = None
        stage_params = dict(self.model.named_parameters())
        self.params: list[tuple[str, nn.Parameter]] = [(m, stage_params[mc.local_name(m, self.layers.start)]) for m in names]
        assert len(self.params) == len(stage_params), (sorted(stage_params), names)
        self._load_hf(model_dir)
        with_value_head = kind == "value" and g.last_stage
        self.value_head = self._build_value_head(model_dir, dtype=DTYPES[dtype], seed=seed) if with_value_head else None
        if self.value_head is not None:
            self.params += [("value_head.weight", self.value_head.weight), ("value_head.bias", self.value_head.bias)]
        self.module = MegatronPolicyModule(self) if kind == "policy" else MegatronValueModule(self)
        trainable = [p for _, p in self.params]
        if optim is None:
            self.model.eval()
            for p in trainable:
                p.requires_grad_(False)
            self.optimizer = self.scheduler = None
        else:
            self.model.train()
            self.optimizer = torch.optim.AdamW(trainable, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                               weight_decay=optim.weight_decay)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim, total_optim_steps))

    # -- construction helpers --

    @property
    def _has_tied_copy(self) -> bool:
        """Whether this rank is the last stage of a pipeline whose policy ties embeddings: megatron keeps a copy of the
        embedding there as ``output_layer.weight``, its gradient summed with the first stage's (``embd_group``)."""
        return self.groups.embd_group is not None and self.groups.last_stage

    def _hf_names(self, megatron_name: str) -> tuple[str, ...]:
        """``mc.hf_names_of``, with the tied copy on the last stage named as the embedding it copies."""
        if megatron_name == "output_layer.weight" and self.arch.tie_embeddings:
            return ("model.embed_tokens.weight",)
        return mc.hf_names_of(megatron_name)

    def _kv_local(self) -> int:
        return self.arch.num_kv_heads // self.groups.tp

    @torch.no_grad()
    def _load_hf(self, model_dir: Path) -> None:
        read = _read_hf_tensors(model_dir)
        for m, p in self.params:
            full = [read(h) for h in self._hf_names(m)]
            p.copy_(mc.tp_shard(m, full, self.arch, tp=self.groups.tp, tp_rank=self.groups.tp_rank))

    def _build_value_head(self, model_dir: Path, *, dtype: torch.dtype, seed: int) -> nn.Linear:
        """``rlspmd.models.value.value_head``: the same head (stored or seeded) as the FSDP critic's."""
        return value_head(model_dir, hidden=self.arch.hidden_size, dtype=dtype, seed=seed).to(self.device)

    def autocast(self):
        if self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return nullcontext()

    def lm_head_weight(self) -> torch.Tensor:
        """This TP rank's vocabulary rows of the LM head (the embedding when tied)."""
        return self.model.shared_embedding_or_output_weight() if self.arch.tie_embeddings else self.model.output_layer.weight

    # -- training --

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    def optimizer_step(self, micro_batches: Iterable, loss_fn: Callable[[object, object], torch.Tensor]) -> UpdateStats:
        """Accumulate the gradient of ``loss_fn(module, mb)`` over ``micro_batches`` through the forward-backward
        schedule (megatron's on CUDA; ``forward_backward`` in ``third_party/megatron_adapter.py``), sum it over DP,
        clip by the global norm, step. Same contract as ``FSDPEngine``: the loss is the micro-batch's share of the
        globally normalised loss; a non-finite norm skips the update.

        With pipeline stages the loss is computed where megatron's schedules compute it, on the last stage: each rank's
        micro-batches go to its pipeline's last stage, which calls ``loss_fn`` once per pipeline member on that
        member's micro-batch (so metrics a loss function records land on the last stage's rank; they are sums
        reduced over ranks, so their totals are unchanged). ``loss_fn`` must call the module on the micro-batch's own
        ``input_ids_BL`` / ``attention_mask_BL`` (asserted)."""
        assert self.optimizer is not None, "optimizer_step on a frozen engine"
        self.optimizer.zero_grad(set_to_none=True)
        micro = list(micro_batches)
        ones = torch.ones((), dtype=torch.int, device=self.device)
        if self.groups.pp == 1:
            def forward_step(data_iterator, model):
                loss = loss_fn(self.module, next(data_iterator))
                return loss, lambda out: (out, ones, {})  # (loss, token count, logged): used as returned

            data = iter(micro)
        else:
            def forward_step(data_iterator, model):
                rows, column = next(data_iterator)
                hidden = stage_forward(self, rows)
                if not self.groups.last_stage:  # what megatron's p2p receives into (config.pipeline_dtype)
                    hidden = hidden.to(self.pipeline_dtype)

                def loss_func(hidden_WNH):  # called on the last stage only
                    loss = sum(loss_fn(_LastStageModule(self.module, hidden_WNH, rows, j), mb) for j, mb in enumerate(column))
                    return loss, ones, {}

                return hidden, loss_func

            data = iter(self._pipeline_micro_batches(micro))
        self.ma.forward_backward(forward_step, data, model=self.model, num_micro_batches=len(micro),
                                 pg_collection=self.pg_collection, device=self.device, pipeline_dtype=self.pipeline_dtype)
        if self.groups.pp > 1 and not self.groups.last_stage:
            # Metrics are reduced over ranks by name, so every rank must record the same names: record this rank's
            # with zero weight, as a zero-weight filler micro-batch does (the values are on the last stage).
            with torch.no_grad():
                loss_fn(_ZeroOutputs(self.module), zero_weight_copy(micro[0]))
        grads = self._sum_grads()
        grad_norm = self._global_grad_norm(grads)
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            max_norm = self.optim_cfg.grad_clip
            if max_norm > 0:  # torch.nn.utils.clip_grad_norm_'s rule, on the global norm
                coef = min(max_norm / (grad_norm + 1e-6), 1.0)
                torch._foreach_mul_(grads, coef)
            self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": grad_norm, "skipped": float(skipped)}

    def _pipeline_micro_batches(self, micro: list) -> list[tuple[GroupRows, list | None]]:
        """Per micro-batch, what the schedule's ``forward_step`` reads on this stage: the model-parallel group's rows
        (every stage runs them) and, on the last stage, the micro-batches of its pipeline's members (stage order).
        Gathered before the schedule starts: a collective inside ``forward_step`` would deadlock the stages, which
        reach a micro-batch's forward at different times."""
        g = self.groups
        out = []
        for mb in micro:
            fp = front_pack(mb["input_ids_BL"], mb["attention_mask_BL"], 1)  # the ids only: response columns unused
            rows = GroupRows.of(gather_front_packed(fp, g.mp_group))
            column = [None] * g.pp if g.last_stage else None
            dist.gather_object(mb, column, group=g.pp_group, group_dst=g.pp - 1)
            out.append((rows, column))
        return out

    def _sum_grads(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient (zeros where a micro-batch never reached it), the tied embedding's
        two copies summed (first and last stage), then summed over DP."""
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.groups.embd_group is not None:
            tied = self.params[0][1] if self.groups.first_stage else dict(self.params)["output_layer.weight"]
            dist.all_reduce(tied.grad, group=self.groups.embd_group)
        grads = [p.grad for _, p in self.params]
        if self.groups.dp > 1:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.groups.dp_group)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        return grads

    def _global_grad_norm(self, grads: list[torch.Tensor]) -> float:
        """L2 norm of the whole model's gradient: TP-sharded tensors summed over the TP group, replicated ones (norms,
        the value head) counted once, each stage's own, the tied embedding's copy on the last stage not again."""
        g = self.groups
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for (name, _), grad in zip(self.params, grads):
            if name == "output_layer.weight" and self._has_tied_copy:
                continue
            if g.tp_rank == 0 or self._tp_sharded(name):
                sq += torch.linalg.vector_norm(grad.float()) ** 2
        if g.tp * g.pp > 1:
            dist.all_reduce(sq, group=g.mp_group)
        return float(sq.sqrt())

    @staticmethod
    def _tp_sharded(megatron_name: str) -> bool:
        return not megatron_name.startswith("value_head.") and mc.hf_shard_dim(mc.hf_names_of(megatron_name)[0]) is not None

    # -- names, pieces, checkpoints --

    def _root(self, hf_name: str) -> str:
        """The name ``hf_name`` has in the FSDP engine's root module (``hf.`` + the HF model's name; a value model's
        backbone is an ``AutoModel``, without the ``model.`` level)."""
        if hf_name.startswith("value_head."):
            return hf_name
        if self.kind == "value":
            hf_name = hf_name.removeprefix("model.")
        return "hf." + hf_name

    def _hf_pieces(self, name: str, local: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(HF name, this rank's piece) of a local megatron tensor (a parameter or an optimiser state of its shape)."""
        if name.startswith("value_head."):
            return [(name, local)]
        pieces = mc.split_megatron(name, local, num_kv_heads=self._kv_local(), head_dim=self.arch.head_dim)
        return list(zip(self._hf_names(name), pieces))

    def _join(self, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        if name.startswith("value_head."):
            return pieces[0]
        return mc.join_megatron(name, pieces, num_kv_heads=self._kv_local(), head_dim=self.arch.head_dim)

    def _distributed(self, hf_name: str, piece: torch.Tensor) -> torch.Tensor:
        """A piece as DCP must see it: a ``DTensor`` shard of the HF tensor over the TP group, or (replicated, or
        ``tp`` 1) the plain tensor, identical on every rank that holds it."""
        dim = None if hf_name.startswith("value_head.") else mc.hf_shard_dim(hf_name)
        if self.groups.tp == 1 or dim is None:
            return piece.detach().clone()
        return DTensor.from_local(piece.detach().contiguous(), self.groups.tp_mesh, [Shard(dim)], run_check=False)

    def _init_optim_state(self) -> None:
        """AdamW's per-parameter state, created as its first step would (zeros), so a checkpoint can load into it."""
        for _, p in self.params:
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def state_dict(self) -> dict:
        """Checkpoint state (``Stateful``) in the FSDP engine's layout and names: ``model`` (root-module names, the
        tied ``lm_head.weight`` listed too), ``optim`` (``state`` per parameter name, ``param_groups``), and
        ``lr_scheduler``. Tensors are this rank's pieces (``_distributed``); nothing is gathered."""
        assert self.optimizer is not None, "a frozen engine has no training state to checkpoint"
        self._init_optim_state()
        model, optim_state, names = {}, {}, []
        for name, p in self.params:
            st = self.optimizer.state[p]
            moments = {k: self._hf_pieces(name, st[k]) for k in ("exp_avg", "exp_avg_sq")}
            for i, (hf, piece) in enumerate(self._hf_pieces(name, p)):
                root = self._root(hf)
                names.append(root)
                model[root] = self._distributed(hf, piece)
                optim_state[root] = {"step": st["step"].clone(),
                                     **{k: self._distributed(hf, moments[k][i][1]) for k in moments}}
        embed = self._root("model.embed_tokens.weight")
        if self.kind == "policy" and self.arch.tie_embeddings and embed in model:
            model[self._root("lm_head.weight")] = model[embed]
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return {"model": model, "optim": {"state": optim_state, "param_groups": [{**group, "params": names}]},
                "lr_scheduler": self.scheduler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self._init_optim_state()
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        for name, p in self.params:
            hf_names = [hf for hf, _ in self._hf_pieces(name, p)]
            p.copy_(self._join(name, [local(state["model"][self._root(h)]) for h in hf_names]))
            saved = [state["optim"]["state"][self._root(h)] for h in hf_names]
            st = self.optimizer.state[p]
            st["step"].copy_(saved[0]["step"])
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(self._join(name, [local(s[k]) for s in saved]))
        for k in ("lr", "initial_lr"):
            self.optimizer.param_groups[0][k] = state["optim"]["param_groups"][0][k]
        self.scheduler.load_state_dict(state["lr_scheduler"])

    def param_shapes(self) -> dict[str, torch.Size]:
        """Global shape of every entry of the model state dict, by (root-module HF) name: every stage's entries."""
        shapes = {self._root(hf): torch.Size(shape) for _, specs, _ in self._global_units() for hf, shape in specs}
        if self.kind == "policy" and self.arch.tie_embeddings:
            shapes[self._root("lm_head.weight")] = shapes[self._root("model.embed_tokens.weight")]
        return shapes

    # -- full weights: export and rollout --

    def _units(self) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
        """This stage's (unit name, [(megatron name, parameter)]) in model order: embedding, each layer, then norm and
        head (the tied embedding's copy on the last stage is not a unit of its own: the first stage's is)."""
        units: dict[str, list] = {}
        for name, p in self.params:
            if name == "output_layer.weight" and self._has_tied_copy:
                continue
            units.setdefault(self._unit_of(name), []).append((name, p))
        return list(units.items())

    @staticmethod
    def _unit_of(name: str) -> str:
        if name.startswith("decoder.layers."):
            return "layers." + name.split(".")[2]
        return "embed" if name.startswith("embedding.") else "head"

    def _global_units(self) -> list[tuple[str, list[tuple[str, tuple[int, ...]]], int]]:
        """Every unit of the whole model: (unit name, [(HF name, full shape)], the pipeline stage that holds it)."""
        shapes = mc.hf_shapes(self.arch)
        per_stage = self.arch.num_layers // self.groups.pp
        with_head = not self.tied
        units: dict[str, tuple[list, int]] = {}
        for name in mc.megatron_names(self.arch, with_head=with_head):
            unit = self._unit_of(name)
            stage = 0 if unit == "embed" else self.groups.pp - 1 if unit == "head" else int(unit.split(".")[1]) // per_stage
            units.setdefault(unit, ([], stage))[0].extend((hf, shapes[hf]) for hf in mc.hf_names_of(name))
        if self.kind == "value":
            units["head"][0].extend([("value_head.weight", (1, self.arch.hidden_size)), ("value_head.bias", (1,))])
        return [(unit, specs, stage) for unit, (specs, stage) in units.items()]

    @torch.no_grad()
    def full_units(self, dtype: torch.dtype) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
        """Each unit's full HF tensors in ``dtype`` on every rank: one all-gather over the TP group of the stage that
        holds the unit (pieces cast before gathering), then, with pipeline stages, one broadcast from that stage down
        the pipeline. Collective over the role's ranks; every rank sees the same units in the same order."""
        g = self.groups
        local = dict(self._units())
        for unit, specs, stage in self._global_units():
            tensors = self._gather_tp(local[unit], dtype) if stage == g.pp_rank else None
            if g.pp > 1:
                if tensors is not None:
                    flat = torch.cat([t.reshape(-1) for _, t in tensors])
                else:
                    flat = torch.empty(sum(math.prod(shape) for _, shape in specs), dtype=dtype, device=self.device)
                dist.broadcast(flat, group=g.pp_group, group_src=stage)
                sizes = [math.prod(shape) for _, shape in specs]
                tensors = [(hf, t.view(shape)) for (hf, shape), t in zip(specs, torch.split(flat, sizes))]
            assert [hf for hf, _ in tensors] == [hf for hf, _ in specs], (unit, [hf for hf, _ in tensors])
            yield unit, tensors

    def _gather_tp(self, params: list[tuple[str, nn.Parameter]], dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        """The full HF tensors of this stage's ``params``: one all-gather of the cast pieces over the TP group."""
        g = self.groups
        pieces = [(hf, piece.to(dtype)) for name, p in params for hf, piece in self._hf_pieces(name, p.detach())]
        if g.tp == 1:
            return pieces
        send = torch.cat([piece.reshape(-1) for _, piece in pieces])
        out = send.new_empty(send.numel() * g.tp)
        _all_gather_flat(out, send, group=g.tp_group)
        per_rank = out.view(g.tp, -1)
        full, offset = [], 0
        for hf, piece in pieces:
            n = piece.numel()
            parts = [per_rank[r, offset : offset + n].view(piece.shape) for r in range(g.tp)]
            dim = None if hf.startswith("value_head.") else mc.hf_shard_dim(hf)
            full.append((hf, parts[0].clone() if dim is None else torch.cat(parts, dim=dim)))
            offset += n
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict under the FSDP root module's names on rank 0 of the mesh; empty elsewhere. Collective."""
        main = self.mesh.get_local_rank() == 0
        out = {}
        for _, tensors in self.full_units(self.params[0][1].dtype):
            if main:
                out.update((self._root(hf), t.to("cpu", copy=True)) for hf, t in tensors)
        if main and self.kind == "policy" and self.arch.tie_embeddings:
            out[self._root("lm_head.weight")] = out[self._root("model.embed_tokens.weight")]
        return out

    @property
    def hf_model(self) -> nn.Module:
        """The HF causal LM of this architecture on the meta device (no memory): what ``save_pretrained(state_dict=
        ...)`` needs to write an HF directory from ``full_state_dict`` (``rlspmd.trainer.checkpoint.save_hf_model``)."""
        assert self.kind == "policy", "only a policy exports as an HF causal LM"
        if self._hf_skeleton is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                self._hf_skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(self.model_dir)))
        return self._hf_skeleton

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """``full_state_dict`` under the HF model's own names (the role wrapper's ``hf.`` prefix stripped)."""
        return {k.removeprefix("hf."): v for k, v in self.full_state_dict().items() if k.startswith("hf.")}

    def weight_stream(self, dtype: torch.dtype) -> "MegatronWeightStream":
        assert self.kind == "policy", "only a policy's weights go to the rollout"
        return MegatronWeightStream(self, dtype=dtype)

    def offload_params(self) -> None:
        """Move the parameters to host memory (a frozen role between uses); ``load_params`` brings them back."""
        self.model.to("cpu")

    def load_params(self) -> None:
        self.model.to(self.device, non_blocking=True)


class MegatronWeightStream:
    """``rlspmd.engines.base.WeightStream``'s contract for a megatron policy: ``(HF name, full tensor)`` unit
    by unit, the same sequence on every rank of the actor mesh (tied embeddings once, under the embedding's name).

    ``gathered_units`` hands out each unit as one flat buffer in the manifest's single-rank layout (``world`` 1), so
    ``WeightBridge`` broadcasts it to split rollout ranks and ``unpack_unit`` cuts it there unchanged."""

    def __init__(self, engine: MegatronEngine, *, dtype: torch.dtype):
        self.engine, self.mesh, self.device, self.dtype = engine, engine.mesh, engine.device, dtype
        units = engine._global_units()
        self._stages = [stage for _, _, stage in units]
        units = [UnitSpec(unit, tuple(ParamSpec(hf, tuple(shape), shape[0]) for hf, shape in specs), 1)
                 for unit, specs, _ in units]
        self.manifest = WeightManifest(units=tuple(units), dtype=dtype)
        self.last = StreamStats()

    def stats(self) -> dict[str, float]:
        return {"weight_sync/gathered_bytes": float(self.last.gathered_bytes)}

    def gathered_units(self) -> Iterator[tuple[UnitSpec, torch.Tensor]]:
        self.last = stats = StreamStats()
        g = self.engine.groups
        for spec, stage, (_, tensors) in zip(self.manifest.units, self._stages, self.engine.full_units(self.dtype)):
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


def build_megatron_engine(
    kind: ModuleKind,
    model_path: str,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    cfg: MegatronConfig,
    optim: OptimConfig | None,
    total_optim_steps: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    gradient_checkpointing: bool = False,
    field_name: str = "actor.model.path",
    field_prefix: str = "actor.megatron",
) -> MegatronEngine:
    """The megatron engine for a role: ``kind`` ``policy`` (actor, reference: ``optim=None``) or ``value`` (critic).

    ``mesh``: the role's mesh (its ranks; the trainer's DP view); ``cfg``: the role's ``megatron`` section;
    ``field_name`` / ``field_prefix`` name the config fields in errors. Collective over the mesh's ranks."""
    if gradient_checkpointing:
        role = field_prefix.split(".")[0]
        raise ValueError(f"{role}: gradient_checkpointing=True is not supported with {role}.engine=megatron yet")
    model_dir = check_model_dir(model_path, field_name=field_name)
    return MegatronEngine(kind, model_dir, mesh=mesh, device=device, cfg=cfg, optim=optim,
                          total_optim_steps=total_optim_steps, dtype=dtype, seed=seed, field_prefix=field_prefix)
