"""The role modules of the megatron engine: this rank's stage and TP shard of a megatron ``GPTModel`` loaded from an HF
Qwen2/Llama directory, with the forward of a policy (log-probs, entropy) or a critic (values).

``build_megatron_module`` is the megatron counterpart of the FSDP builder's role module: the trainer's builder
(``rlspmd/trainer/build.py``) makes it and hands it to ``MegatronEngine``, which adds the optimiser, the update's
forward-backward schedule, checkpoints and the weight stream. Unlike an HF module for FSDP, a megatron module is
built already split (megatron's layers are created as their TP shard and pipeline stage), so building it makes the
role's process groups (``rlspmd.distributed.mesh.model_parallel_groups``).

What differs between a policy and a critic is the module class's own behaviour, never a test of a kind: the head
(``head``, ``n_out``, ``wrap``), whether the LM head is read (``reads_lm_head``) or is the embedding
(``tied_lm_head``), the value head's parameters, and the HF names (``backbone_name``, ``hf_auto_class``).

A call is collective over the model-parallel group (the ``tp x pp`` ranks of a replica): the group's rows run through
the model together (``packing.GroupRows``) and each rank gets its own rows' outputs. The LM head runs in
``chunked_logprobs`` with the full vocabulary (the TP shards of the head are gathered, once per forward). Under
autograd the outputs carry a hook that sums their gradient over the TP group, so every TP rank back-propagates the
same total loss (the sum of its members' losses), which is what tensor parallelism needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.distributed.mesh import model_parallel_groups
from rlspmd.distributed.tp_batch import keep_own_rows
from rlspmd.engines.base import compute_dtype
from rlspmd.engines.megatron.packing import FrontPacked, GroupRows, front_pack, gather_front_packed
from rlspmd.engines.pipeline import StageP2P
from rlspmd.models import megatron_convert as mc
from rlspmd.models.loader import DTYPES, check_model_dir
from rlspmd.models.logprobs import DEFAULT_CHUNK, chunked_logprobs
from rlspmd.models.value import value_head

ModuleKind = Literal["policy", "value"]


class MegatronLayout(Protocol):
    """What a module reads of its engine's config (``MegatronConfig``): the parallel layout and the compute dtype."""

    tp: int
    pp: int
    param_dtype: str


# -- autograd pieces for tensor parallelism (the output-gradient sum is distributed/tp_batch.py's) -----------------


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, *, group) -> None:
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
        all_gather_flat(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows : (rank + 1) * ctx.rows], None


Head = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
"""``head(hidden_NH, targets_N)``: the per-token outputs (log-probs and entropy, or values) of selected positions."""


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
        key = name if prefixed or not name.startswith("model.") else name[len("model.") :]
        if key not in where:
            raise ValueError(f"{model_dir}: the safetensors have no tensor {key!r}")
        with safe_open(str(where[key]), framework="pt") as st:
            return st.get_tensor(key)

    return read


class MegatronModule:
    """This rank's part of a megatron ``GPTModel`` (its pipeline stage, its TP shard), loaded from ``model_dir``, with
    the role's forward (``__call__``: the signature of the FSDP role module it stands for).

    ``params``: the trainable ``(megatron name, parameter)`` pairs of this stage in model order (the value head last).
    With pipeline stages a call runs without autograd only (training goes through the engine's ``optimizer_step``):
    the hidden states pass stage to stage and the last stage broadcasts every member's outputs down its pipeline."""

    n_out: int
    """How many ``(B, R)`` outputs the head returns per token (log-probs and entropy: 2; values: 1)."""
    reads_lm_head: bool
    """Whether the forward reads the LM head (a value model does not: it is built tied, so no output layer is
    allocated)."""
    hf_auto_class: str
    """The ``transformers`` auto class of the HF model these weights are (``hf_model``)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        mesh: DeviceMesh,
        device: torch.device,
        cfg: MegatronLayout,
        dtype: str,
        seed: int,
        field_prefix: str,
    ):
        from third_party import megatron_adapter as ma  # lazily: megatron-core is optional

        self.device, self.model_dir = device, model_dir
        self._hf_skeleton: nn.Module | None = None
        self.arch = mc.megatron_arch(json.loads((model_dir / "config.json").read_text()), field_name=str(model_dir))
        mc.check_parallel(self.arch, tp=cfg.tp, pp=cfg.pp, field_prefix=field_prefix)
        # A model that never reads the LM head is built tied, so no output-layer weight is allocated (on a last stage
        # without the embedding megatron allocates one anyway; it is dropped below).
        self.tied = self.tied_lm_head or not self.reads_lm_head
        self.groups = g = model_parallel_groups(
            mesh, tp=cfg.tp, pp=cfg.pp, field_prefix=field_prefix, pipeline_ends=self.tied_lm_head
        )
        self.compute_dtype = compute_dtype(cfg.param_dtype, device)
        self.pipeline_dtype = DTYPES[dtype]
        ma.no_dropout_rng_tracker()
        config = ma.transformer_config(
            self.arch, tp=g.tp, pp=g.pp, params_dtype=DTYPES[dtype], cpu=device.type == "cpu"
        )
        self.pg_collection = ma.process_groups(tp=g.tp_group, pp=g.pp_group, cp=g.cp_group, dp=g.dp_group, embd=None)
        self.model = ma.gpt_model(
            config,
            self.arch,
            pg_collection=self.pg_collection,
            pre_process=g.first_stage,
            post_process=g.last_stage,
            tie_embeddings=self.tied,
            device=device,
        )
        self.p2p = StageP2P(g.pp_group, dtype=self.pipeline_dtype, device=device) if g.pp > 1 else None
        self.layers = mc.stage_layers(self.arch.num_layers, pp=g.pp, pp_rank=g.pp_rank)
        names = mc.stage_names(self.arch, self.layers, first=g.first_stage, last=g.last_stage, with_head=not self.tied)
        if self.has_tied_copy:  # the last stage's copy of the tied embedding (megatron's output_layer)
            names.append("output_layer.weight")
        elif not self.reads_lm_head and g.last_stage and not g.first_stage:
            self.model.output_layer.weight = None
        stage_params = dict(self.model.named_parameters())
        self.params: list[tuple[str, nn.Parameter]] = [
            (m, stage_params[mc.local_name(m, self.layers.start)]) for m in names
        ]
        assert len(self.params) == len(stage_params), (sorted(stage_params), names)
        self._load_hf(model_dir)
        self.params += self._build_head_params(model_dir, dtype=DTYPES[dtype], seed=seed)

    # -- what a policy and a critic do differently --

    @property
    def tied_lm_head(self) -> bool:
        """Whether the HF model's ``lm_head.weight`` is the embedding (listed under both names, stored once)."""
        raise NotImplementedError

    def _build_head_params(self, model_dir: Path, *, dtype: torch.dtype, seed: int) -> list[tuple[str, nn.Parameter]]:
        """Parameters of a head outside megatron's model (none for a policy)."""
        return []

    def head_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(HF name, shape)`` of those parameters, in the ``head`` unit of the whole model."""
        return []

    def backbone_name(self, hf_name: str) -> str:
        """The name an HF causal-LM tensor has in the HF model this module stands for."""
        return hf_name

    def head(self, **kw) -> Head:
        raise NotImplementedError

    def wrap(self, outs: tuple[torch.Tensor, ...]):
        raise NotImplementedError

    # -- construction helpers --

    @property
    def has_tied_copy(self) -> bool:
        """Whether this rank is the last stage of a pipeline whose policy ties embeddings: megatron keeps a copy of the
        embedding there as ``output_layer.weight``, its gradient summed with the first stage's (``embd_group``)."""
        return self.groups.embd_group is not None and self.groups.last_stage

    def hf_names(self, megatron_name: str) -> tuple[str, ...]:
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
            full = [read(h) for h in self.hf_names(m)]
            p.copy_(mc.tp_shard(m, full, self.arch, tp=self.groups.tp, tp_rank=self.groups.tp_rank))

    def autocast(self):
        if self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return nullcontext()

    def lm_head_weight(self) -> torch.Tensor:
        """This TP rank's vocabulary rows of the LM head (the embedding when tied)."""
        return (
            self.model.shared_embedding_or_output_weight()
            if self.arch.tie_embeddings
            else self.model.output_layer.weight
        )

    # -- names and pieces: the HF identity of each megatron tensor --

    @staticmethod
    def tp_sharded(megatron_name: str) -> bool:
        return (
            not megatron_name.startswith("value_head.")
            and mc.hf_shard_dim(mc.hf_names_of(megatron_name)[0]) is not None
        )

    def root_name(self, hf_name: str) -> str:
        """The name ``hf_name`` has in the FSDP engine's root module (``hf.`` + the HF model's name)."""
        if hf_name.startswith("value_head."):
            return hf_name
        return "hf." + self.backbone_name(hf_name)

    def hf_pieces(self, name: str, local: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(HF name, this rank's piece) of a local megatron tensor (a parameter or an optimiser state of its shape)."""
        if name.startswith("value_head."):
            return [(name, local)]
        pieces = mc.split_megatron(name, local, num_kv_heads=self._kv_local(), head_dim=self.arch.head_dim)
        return list(zip(self.hf_names(name), pieces))

    def join(self, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        if name.startswith("value_head."):
            return pieces[0]
        return mc.join_megatron(name, pieces, num_kv_heads=self._kv_local(), head_dim=self.arch.head_dim)

    def units(self) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
        """This stage's (unit name, [(megatron name, parameter)]) in model order: embedding, each layer, then norm and
        head (the tied embedding's copy on the last stage is not a unit of its own: the first stage's is)."""
        units: dict[str, list] = {}
        for name, p in self.params:
            if name == "output_layer.weight" and self.has_tied_copy:
                continue
            units.setdefault(self._unit_of(name), []).append((name, p))
        return list(units.items())

    @staticmethod
    def _unit_of(name: str) -> str:
        if name.startswith("decoder.layers."):
            return "layers." + name.split(".")[2]
        return "embed" if name.startswith("embedding.") else "head"

    def global_units(self) -> list[tuple[str, list[tuple[str, tuple[int, ...]]], int]]:
        """Every unit of the whole model: (unit name, [(HF name, full shape)], the pipeline stage that holds it)."""
        shapes = mc.hf_shapes(self.arch)
        per_stage = self.arch.num_layers // self.groups.pp
        units: dict[str, tuple[list, int]] = {}
        for name in mc.megatron_names(self.arch, with_head=not self.tied):
            unit = self._unit_of(name)
            stage = (
                0 if unit == "embed" else self.groups.pp - 1 if unit == "head" else int(unit.split(".")[1]) // per_stage
            )
            units.setdefault(unit, ([], stage))[0].extend((hf, shapes[hf]) for hf in mc.hf_names_of(name))
        units["head"][0].extend(self.head_specs())
        return [(unit, specs, stage) for unit, (specs, stage) in units.items()]

    @property
    def hf_model(self) -> nn.Module:
        """The HF model of these weights on the meta device (no memory): what ``save_pretrained(state_dict=...)`` needs
        to write an HF directory (``rlspmd.trainer.checkpoint.save_hf_model``). Built on first use."""
        if self._hf_skeleton is None:
            import transformers

            auto = getattr(transformers, self.hf_auto_class)
            with torch.device("meta"):
                self._hf_skeleton = auto.from_config(transformers.AutoConfig.from_pretrained(str(self.model_dir)))
        return self._hf_skeleton

    # -- the forward --

    def __call__(self, input_ids_BL, attention_mask_BL, position_ids_BL, *, response_len: int, **kw):
        g = self.groups
        head = self.head(**kw)
        mine = front_pack(input_ids_BL, attention_mask_BL, response_len)
        members = gather_front_packed(mine, g.mp_group) if g.tp * g.pp > 1 else [mine]
        rows = GroupRows.of(members)
        if g.pp == 1:
            return self.wrap(member_outputs(self, stage_forward(self, rows), rows, members, pp_index=0, head=head))
        if torch.is_grad_enabled():
            raise RuntimeError(
                "with pipeline parallelism the module runs without autograd only (torch.no_grad()); "
                "training goes through optimizer_step"
            )
        self.model.set_input_tensor(None if g.first_stage else self.p2p.recv_prev())
        hidden = stage_forward(self, rows)
        self.model.set_input_tensor(None)
        if not g.last_stage:
            self.p2p.send_next(hidden)
        # Every member's outputs, stage order, flat: computed on the last stage, broadcast down the pipeline.
        sizes = [self.n_out * members[j * g.tp + g.tp_rank].resp_valid_BR.numel() for j in range(g.pp)]
        if g.last_stage:
            flat = torch.cat(
                [
                    o.flatten()
                    for j in range(g.pp)
                    for o in member_outputs(
                        self, hidden, rows, members[j * g.tp : (j + 1) * g.tp], pp_index=j, head=head
                    )
                ]
            )
        else:
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
        dist.broadcast(flat, group=g.pp_group, group_src=g.pp - 1)
        shape_BR = mine.resp_valid_BR.shape
        own = flat[sum(sizes[: g.pp_rank]) : sum(sizes[: g.pp_rank + 1])].view(self.n_out, *shape_BR)
        return self.wrap(tuple(own.unbind(0)))


def stage_forward(module: MegatronModule, rows: GroupRows) -> torch.Tensor:
    """This stage's layers over ``rows``: from the token ids on the first stage, else from the input tensor the
    schedule set (``model.set_input_tensor``). Returns ``(W, N, hidden)`` (after the final norm on the last stage)."""
    W, N = rows.hidden_shape
    cols = torch.arange(W, device=rows.ids_NW.device)
    with module.autocast():
        hidden_WNH = module.model(rows.ids_NW, cols.expand(N, W), rows.mask_N1WW)
    assert hidden_WNH.shape == (W, N, module.arch.hidden_size), f"expected hidden states, got {tuple(hidden_WNH.shape)}"
    return hidden_WNH


def member_outputs(
    module: MegatronModule,
    hidden_WNH: torch.Tensor,
    rows: GroupRows,
    tp_members: list[FrontPacked],
    *,
    pp_index: int,
    head: Head,
) -> tuple[torch.Tensor, ...]:
    """``head`` on the hidden states that predict response tokens, for the rows of pipeline member ``pp_index``'s TP
    group (``tp_members``, with their response columns); returns this TP rank's member's ``(B, R)`` outputs. Under
    autograd the group's outputs carry ``SumGradOverGroup`` (``keep_own_rows`` over the member's token counts): every
    TP rank back-propagates the group's total loss."""
    g, hidden = module.groups, hidden_WNH.transpose(0, 1)
    # Response token at index p is predicted by the hidden state at p - 1 (a prompt token comes first).
    sel, pos, counts = [], [], []
    for t, m in enumerate(tp_members):
        r, c = m.resp_valid_BR.nonzero(as_tuple=True)
        sel.append(r + rows.offsets[pp_index * g.tp + t])
        pos.append(m.resp_pos_BR[r, c])
        counts.append(len(r))
    sel, pos = torch.cat(sel), torch.cat(pos)
    with module.autocast():
        outs = head(hidden[sel, pos - 1], rows.ids_NW[sel, pos])
    valid = tp_members[g.tp_rank].resp_valid_BR
    result = []
    for out_N in outs:
        own = (keep_own_rows(out_N, counts, g.tp_group) if g.tp > 1 else out_N).float()
        result.append(own.new_zeros(valid.shape).masked_scatter(valid, own))
    return tuple(result)


class LastStageModule:
    """What ``loss_fn`` gets on the last pipeline stage for pipeline member ``pp_index``'s micro-batch: the module's
    signature, computing the head over the hidden states the pipeline produced (the member's rows)."""

    def __init__(self, module: MegatronModule, hidden_WNH: torch.Tensor, rows: GroupRows, pp_index: int):
        self.module, self.hidden_WNH, self.rows, self.pp_index = module, hidden_WNH, rows, pp_index

    def __call__(self, input_ids_BL, attention_mask_BL, position_ids_BL, *, response_len: int, **kw):
        g = self.module.groups
        mine = front_pack(input_ids_BL, attention_mask_BL, response_len)
        ran = self.rows.members[self.pp_index * g.tp + g.tp_rank].ids_BW
        assert torch.equal(mine.ids_BW, ran), (
            "loss_fn must call the module on its micro-batch's input_ids_BL/attention_mask_BL"
        )
        tp_members = gather_front_packed(mine, g.tp_group) if g.tp > 1 else [mine]
        outs = member_outputs(
            self.module, self.hidden_WNH, self.rows, tp_members, pp_index=self.pp_index, head=self.module.head(**kw)
        )
        return self.module.wrap(outs)


class ZeroOutputs:
    """The module's signature returning zeros: what ``loss_fn`` gets on a stage that only records metric names."""

    def __init__(self, module: MegatronModule):
        self.module = module

    def __call__(self, input_ids_BL, attention_mask_BL, position_ids_BL, *, response_len: int, **kw):
        zeros = torch.zeros(input_ids_BL.shape[0], response_len, device=input_ids_BL.device)
        return self.module.wrap((zeros,) * self.module.n_out)


class MegatronPolicyModule(MegatronModule):
    """The policy forward with ``CausalLMPolicy``'s signature: ``module(input_ids_BL, attention_mask_BL,
    position_ids_BL, *, response_len, temperature=1.0, with_entropy=True) -> (logprobs_BR, entropy_BR)``.

    ``position_ids_BL`` is not read: positions follow from the mask (see ``packing.front_pack``)."""

    n_out = 2
    reads_lm_head = True
    hf_auto_class = "AutoModelForCausalLM"

    def __init__(self, model_dir: Path, *, logprob_chunk: int | None = DEFAULT_CHUNK, **kw):
        self.logprob_chunk = logprob_chunk
        super().__init__(model_dir, **kw)

    @property
    def tied_lm_head(self) -> bool:
        return self.arch.tie_embeddings

    def head(self, *, temperature: float = 1.0, with_entropy: bool = True) -> Head:
        def logprobs(hidden_NH, targets_N):
            weight = self.lm_head_weight()
            if self.groups.tp > 1:
                weight = _GatherRows.apply(weight, self.groups.tp_group)
            return chunked_logprobs(
                hidden_NH,
                weight,
                targets_N,
                temperature=temperature,
                chunk_size=self.logprob_chunk,
                with_entropy=with_entropy,
            )

        return logprobs

    def wrap(self, outs):
        return outs


class MegatronValueModule(MegatronModule):
    """The critic forward with ``ValueModel``'s signature: ``module(input_ids_BL, attention_mask_BL, position_ids_BL,
    *, response_len) -> values_BR`` (V of the state before each response token), from a scalar value head on the
    final hidden states (on the last stage; the same head, stored or seeded, as the FSDP critic's)."""

    n_out = 1
    reads_lm_head = False
    hf_auto_class = "AutoModel"  # the backbone: a value model's HF names have no ``model.`` level

    @property
    def tied_lm_head(self) -> bool:
        return False

    def _build_head_params(self, model_dir: Path, *, dtype: torch.dtype, seed: int) -> list[tuple[str, nn.Parameter]]:
        """``rlspmd.models.value.value_head`` on the last stage."""
        self.value_head = None
        if not self.groups.last_stage:
            return []
        self.value_head = value_head(model_dir, hidden=self.arch.hidden_size, dtype=dtype, seed=seed).to(self.device)
        return [("value_head.weight", self.value_head.weight), ("value_head.bias", self.value_head.bias)]

    def head_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("value_head.weight", (1, self.arch.hidden_size)), ("value_head.bias", (1,))]

    def backbone_name(self, hf_name: str) -> str:
        return hf_name.removeprefix("model.")

    def head(self) -> Head:
        head = self.value_head

        def values(hidden_NH, _targets_N):
            return ((torch.matmul(hidden_NH, head.weight[0]) + head.bias[0]).float(),)

        return values

    def wrap(self, outs):
        return outs[0]


MODULES: dict[ModuleKind, type[MegatronModule]] = {"policy": MegatronPolicyModule, "value": MegatronValueModule}


def build_megatron_module(
    kind: ModuleKind,
    model_path: str,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    cfg: MegatronLayout,
    dtype: str = "float32",
    seed: int = 0,
    field_name: str = "actor.model.path",
    field_prefix: str = "actor.engine",
) -> MegatronModule:
    """A role's megatron module: ``kind`` ``policy`` (actor, reference) or ``value`` (critic; its value head seeded by
    ``seed`` unless the directory has one), parameters in ``dtype``.

    ``mesh``: the role's mesh (its ranks; the trainer's DP view); ``cfg``: the role's ``megatron`` section;
    ``field_name`` / ``field_prefix`` name the config fields in errors. Collective over the mesh's ranks."""
    model_dir = check_model_dir(model_path, field_name=field_name)
    return MODULES[kind](
        model_dir, mesh=mesh, device=device, cfg=cfg, dtype=dtype, seed=seed, field_prefix=field_prefix
    )
