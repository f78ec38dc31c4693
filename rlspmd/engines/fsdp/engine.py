"""The FSDP2 training engine (``engines/base.py: InPlaceEngine``): the one parallelize path shared by actor,
reference, critic and reward model.

The engine applies, in this order (torchtitan's): tensor parallelism (``apply_tp``, with ``mesh.actor_tp`` > 1),
activation checkpointing (``apply_ac``), then FSDP2 per decoder layer and at the root (``apply_fsdp``). Roles build
their module (policy, value model, ...) and hand it here; nothing else wraps models.

**Tensor parallel + FSDP2 (2-D).** Given a ``(dp, tp)`` mesh (``RoleMeshes.train_mesh``), each decoder layer gets a
``parallelize_module`` plan on ``tp``: q/k/v and gate/up column-wise, o/down row-wise (Megatron's MLP/attention
split: one all-reduce after attention and one after the MLP, in forward and in backward). Attention needs no patch:
HF's Llama/Qwen2/Qwen3 attention and rlspmd's packed kernels read the head count from the projections' output
shapes (``view(..., -1, head_dim)``), so they see the local heads. The embedding, final norm, norms and LM head stay
replicated over ``tp`` (FSDP2 still shards them over ``dp``): exact with no vocab-parallel cross entropy, and the
log-prob kernel (``models/logprobs.py``) and packing run unchanged on full-vocabulary logits; the cost is the vocab
matrix not split over ``tp``. ``fully_shard`` then runs on ``dp``, making every TP parameter a 2-D DTensor. Data: the
trainer gives every rank its own rows (``engine.mesh`` stays the role's flat mesh over all its ranks); hooks on the
root run the TP group's micro-batches together and hand each rank its own outputs (``distributed/tp_batch.py``).

**Expert parallel + FSDP2.** Given an ``(edp, ep)`` mesh (``RoleMeshes.expert_mesh``, ``mesh.actor_ep`` > 1), the
experts of every MoE layer (``models/moe.py: MoEBlock``) become ``DTensor``s sharded over ``ep`` (``apply_ep``) and
each layer's experts module is ``fully_shard``-ed over ``edp`` on its dim 1 (the ranks that hold the same experts; dim
1 so that every rank's shard stays one contiguous block of the global tensor), before the layer itself is sharded
over the role's DP mesh with the dense parameters. Gradients of the experts are summed over ``edp``; their tokens'
contributions from the other EP ranks arrive through the ``all_to_all``'s backward. The gradient norm is taken per
mesh (``grad_norm_2d``), and the weight stream gathers each tensor whole (as with TP).

**Sequence parallel + FSDP2.** Given a sequence-parallel group (``RoleMeshes.sequence_mesh``, ``mesh.actor_sp`` > 1),
the role module's packed forwards split the group's rows over its ranks (``distributed/sequence_parallel.py``): the
parameters stay FSDP2-sharded over all the role's ranks (each rank's gradient is its slice's share; the sum over ranks
is the whole), and ``optimizer_step`` runs each micro-batch as ``sp`` turns, one member's rows at a time, so a
backward holds ``1 / sp`` of one micro-batch's activations. It composes with tensor parallelism (attention heads split
over ``tp`` first, then over ``sp``) and LoRA.

Gradients are *summed* over DP ranks (gradient divide factor 1): losses are already normalised by the
global batch (see ``rlspmd.algorithms.aggregation``), so the gradient does not depend on the number of
ranks or micro-batches.

The optimiser (``engines/optim.py``, shared with the megatron engine) is AdamW, fused (one kernel for all parameters)
on CUDA and CPU alike, offloaded parameters included (``fsdp.fused_adamw``). On the fused path an update with a
non-finite gradient norm is skipped on the device (the kernel's ``found_inf`` input, GradScaler's protocol), so
``update`` reads nothing back to the host; ``optimizer_step`` is the same with its statistics returned as Python
floats (one device-to-host copy per optimiser step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rlspmd.distributed.sequence_parallel import SequenceParallel, resolve_sp_mode
from rlspmd.distributed.tp_batch import gather_group_rows, keep_own_rows
from rlspmd.engines.base import UpdateStats
from rlspmd.engines.optim import OptimConfig, Optimizer
from rlspmd.engines.weight_stream import WeightStream
from rlspmd.models.loader import DTYPES, decoder_layers
from rlspmd.models.moe import apply_ep, moe_blocks
from rlspmd.models.policy import CausalLMPolicy
from rlspmd.models.sharded_load import WeightPlan, is_meta, materialize
from rlspmd.models.value import ValueModel
from rlspmd.models.vision import vision_blocks


class FSDPOptions(Protocol):
    """What the engine reads of its config (``FSDPConfig``, ``config.py``): the sharding and mixed-precision options."""

    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool | None
    cpu_offload: bool
    fused_adamw: bool | None
    gather_once_per_update: bool
    compile_norms: bool | None

    def compute_dtype(self, device: torch.device) -> torch.dtype: ...


TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}
"""Per decoder layer (Llama-family names): column-wise projections into the heads / MLP columns, row-wise out."""


def check_tp(hf_model: nn.Module, tp: int) -> None:
    """``tp`` divides the heads and KV heads, and every layer has the plan's projections (a clear ValueError)."""
    cfg = hf_model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % tp or kv % tp:
        raise ValueError(
            f"mesh.actor_tp={tp} must divide the model's {heads} attention heads and {kv} KV heads "
            f"({cfg.model_type}); pick a divisor of both"
        )
    for i, layer in enumerate(decoder_layers(hf_model)):
        missing = [name for name in TP_PLAN if not _has_submodule(layer, name)]
        if missing:
            raise ValueError(
                f"mesh.actor_tp={tp}: decoder layer {i} of {type(hf_model).__name__} has no {missing} "
                f"(tensor parallelism knows Llama-family layers: {sorted(TP_PLAN)})"
            )


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        return isinstance(module.get_submodule(name), nn.Linear)
    except AttributeError:
        return False


def _with_last(items: Iterable) -> Iterator[tuple[object, bool]]:
    """``(item, is_last)`` for each of ``items``, read one ahead (a generator of micro-batches stays lazy)."""
    it = iter(items)
    end = object()
    nxt = next(it, end)
    while nxt is not end:
        item, nxt = nxt, next(it, end)
        yield item, nxt is end


def apply_tp(hf_model: nn.Module, *, tp_mesh: DeviceMesh) -> None:
    """Shard each decoder layer's heads and MLP columns/rows over ``tp_mesh`` (``TP_PLAN``); the rest stays
    replicated."""
    check_tp(hf_model, tp_mesh.size())
    for layer in decoder_layers(hf_model):
        parallelize_module(layer, tp_mesh, {name: style() for name, style in TP_PLAN.items()})


class TPGroupRows:
    """Forward hooks on the root module: its ``(input_ids, attention_mask, position_ids)`` become the TP group's rows
    (``gather_group_rows``) and its outputs this rank's rows again (``keep_own_rows``). The role calls the module as
    it does without TP."""

    def __init__(self, module: nn.Module, group):
        self.group, self.rows = group, None
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, with_kwargs=True)

    def before(self, module, args, kwargs):
        assert len(args) == 3, (
            "the TP engine's module takes (input_ids_BL, attention_mask_BL, position_ids_BL) positionally"
        )
        args, self.rows = gather_group_rows(args, self.group)
        return tuple(args), {**kwargs, **({"counts": None} if "counts" in kwargs else {})}  # counts were this rank's

    def after(self, module, args, kwargs, out):
        rows, self.rows = self.rows, None

        def own(o):  # a policy's per-token extras come as a dict of (B, R) tensors (models/policy.py)
            if isinstance(o, dict):
                return {k: keep_own_rows(v, rows, self.group) for k, v in o.items()}
            return keep_own_rows(o, rows, self.group)

        return tuple(own(o) for o in out) if isinstance(out, tuple) else own(out)


def apply_sp(
    module: nn.Module, hf_model: nn.Module, *, sp_mesh: DeviceMesh, mode: str, train_mesh: DeviceMesh | None
) -> SequenceParallel:
    """Make ``module`` (a policy or value model: its ``seq``) split its packed forwards over ``sp_mesh``; ``mode``
    (``mesh.actor_sp_mode``) resolved against the model's heads (after ``train_mesh``'s tensor parallelism)."""
    cfg = hf_model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    tp = 1 if train_mesh is None else train_mesh["tp"].size()
    resolved = resolve_sp_mode(mode, heads=heads, kv_heads=kv, sp=sp_mesh.size(), tp=tp)
    assert isinstance(module, (CausalLMPolicy, ValueModel)) and module.packing, (
        "sequence parallelism splits packed policy and value forwards (rlspmd.validate)"
    )
    assert not isinstance(module, CausalLMPolicy) or module.moe is None, "no MoE models under sequence parallelism"
    module.seq = SequenceParallel(sp_mesh.get_group(), mode=resolved)
    return module.seq


def grad_norm_2d(params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients of parameters that live on different meshes and placements (2-D TP
    weights, 1-D FSDP norms): one norm per (mesh, placements) group, reduced by DTensor, then combined."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:  # first-appearance order: the same on every rank
        g = p.grad
        groups.setdefault((g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None, []).append(g)
    total = None
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        n = (n.full_tensor() if isinstance(n, DTensor) else n).float()
        total = n.square() if total is None else total + n.square()
    return total.sqrt()


def compiles_norms(cfg: FSDPOptions, device: torch.device) -> bool:
    """``fsdp.compile_norms``, None resolved: on for bfloat16 compute on CPU."""
    if cfg.compile_norms is not None:
        return cfg.compile_norms
    return device.type == "cpu" and cfg.compute_dtype(device) == torch.bfloat16


def rms_norms(hf_model: nn.Module) -> list[nn.Module]:
    """The RMSNorm modules of ``hf_model``'s language model (each decoder layer's, q/k norms included, and the final
    one), by transformers' class names (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ...)."""
    return [m for m in hf_model.get_decoder().modules() if type(m).__name__.endswith("RMSNorm")]


def compile_norms(hf_model: nn.Module) -> None:
    """``torch.compile`` each of ``rms_norms(hf_model)`` in place (``fsdp.compile_norms``). Before ``fully_shard``:
    FSDP2's hooks stay on the decoder layers, and a compiled norm sees the gathered compute-dtype weight as a plain
    tensor."""
    for m in rms_norms(hf_model):
        m.compile()


def apply_ac(module: nn.Module, hf_model: nn.Module) -> None:
    """Activation checkpointing per decoder layer (non-reentrant, so it composes with FSDP2)."""
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def keeps_gathered_for_backward(cfg: FSDPOptions, mesh: DeviceMesh, device: torch.device) -> bool:
    """``fsdp.reshard_after_forward=None`` on CPU over a one-rank mesh: within an update, each unit keeps its
    compute-dtype copy from its forward to its backward. Nothing is sharded there; resharding after forward only frees
    that copy, which backward then casts again for every layer. Keeping it made a SmolLM2-135M update 8 % faster on a
    2-core Xeon (3.52 against 3.83 s), for 2 bytes per parameter more at the update's peak (bfloat16 compute). Forwards
    outside an update (reference, old log-probs, validation) still reshard: the parameters between steps are the
    sharded ones, as everything that reads them (checkpoints, weight sync) expects."""
    return cfg.reshard_after_forward is None and device.type == "cpu" and mesh.size() == 1


def mixed_precision(cfg: FSDPOptions, device: torch.device, mesh: DeviceMesh) -> MixedPrecisionPolicy:
    """FSDP2 mixed precision for units sharded over ``mesh``: compute in ``cfg.compute_dtype``, reduce gradients in
    ``cfg.reduce_dtype``, except over a one-rank mesh (without ``gather_once_per_update``), where they are reduced in
    the compute dtype. One rank sums nothing: its compute-dtype gradient, cast to the master weights' dtype, is the
    same number whether the cast comes before FSDP2's copies or after (bit-identical, tested), and the copies move
    half the bytes. SmolLM2-135M update on a 2-core Xeon in bfloat16 (``stage_ablation.py``, 8 alternating rounds):
    2.16 against 2.21 s. ``gather_once_per_update`` accumulates gradients across micro-batches in the reduce dtype, so
    it keeps ``reduce_dtype``."""
    compute = cfg.compute_dtype(device)
    one_rank = mesh.size() == 1 and not cfg.gather_once_per_update
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute if one_rank else DTYPES[cfg.reduce_dtype])


def apply_fsdp(
    module: nn.Module,
    hf_model: nn.Module,
    *,
    mesh: DeviceMesh,
    cfg: FSDPOptions,
    device: torch.device,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """``fully_shard`` each decoder layer (and each block of a vision tower), then the root (embeddings, final norm,
    heads; a vision tower's patch embedding and merger). ``expert_mesh``: the MoE layers' expert-parallel experts are
    sharded over its ``edp`` dim first (see the module docstring)."""
    kwargs = dict(
        mesh=mesh,
        mp_policy=mixed_precision(cfg, device, mesh),
        reshard_after_forward=cfg.reshard_after_forward is not False,
    )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    units: list[tuple[nn.Module, DeviceMesh]] = []
    if expert_mesh is not None:
        edp = expert_mesh["edp"]
        for block in moe_blocks(module):
            fully_shard(
                block.experts,
                **{**kwargs, "mesh": edp, "mp_policy": mixed_precision(cfg, device, edp)},
                shard_placement_fn=lambda p: Shard(1),
            )
            units.append((block.experts, edp))
    for layer in [*vision_blocks(hf_model), *decoder_layers(hf_model)]:
        fully_shard(layer, **kwargs)
        units.append((layer, mesh))
    fully_shard(module, **kwargs)
    units.append((module, mesh))
    for m, unit_mesh in units:
        if unit_mesh.size() == 1:
            # One rank sums over nothing: FSDP2 then copies the gradients out, where a divide factor (even 1) costs a
            # division into a fresh buffer per unit and backward (0.9 s of a SmolLM2-135M update on a 2-core CPU).
            continue
        # Sum, not average: the loss is already normalised by the global batch. A plain SUM reduction
        # (rather than NCCL's PREMUL_SUM) also works on Gloo.
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)


class FSDPEngine:
    """An FSDP2-sharded module with (optionally) its optimiser and LR schedule.

    ``module`` is the role's root (e.g. ``CausalLMPolicy``); ``hf_model`` is the HF model inside it, whose
    decoder layers are the sharding units. Frozen roles (reference) pass ``optim=None``. A module built on the meta
    device (``models/sharded_load.py``) comes with ``weights``: after the parallelism is applied, each rank allocates
    its shards and reads them from the files.

    ``mesh`` is the role's mesh over all its ranks (the data's: loss counts, micro-batch counts, metrics). With
    ``train_mesh`` (a 2-D ``(dp, tp)`` mesh over the same ranks) the module is tensor-parallel over ``tp`` and
    FSDP2-sharded over ``dp`` instead (see the module docstring).
    """

    def __init__(
        self,
        module: nn.Module,
        hf_model: nn.Module,
        *,
        mesh: DeviceMesh,
        device: torch.device,
        fsdp: FSDPOptions,
        optim: OptimConfig | None = None,
        total_optim_steps: int = 1,
        gradient_checkpointing: bool = False,
        fused_optimizer: bool | None = None,
        weights: WeightPlan | None = None,
        train_mesh: DeviceMesh | None = None,
        expert_mesh: DeviceMesh | None = None,
        sequence_mesh: DeviceMesh | None = None,
        sequence_mode: str = "auto",
    ):
        """``fused_optimizer``: fused AdamW (None: ``fsdp.fused_adamw``).
        ``weights``: where the parameters of a meta-built ``module`` come from. ``train_mesh``: ``(dp, tp)``, tensor
        parallel + FSDP2. ``expert_mesh``: ``(edp, ep)``, expert parallel for the MoE layers + FSDP2.
        ``sequence_mesh``: this rank's sequence-parallel group (1-D), ``sequence_mode`` its attention
        (``mesh.actor_sp_mode``)."""
        self.mesh = mesh
        self.train_mesh = train_mesh
        self.expert_mesh = expert_mesh
        self.device = device
        self.reshard_after_forward = fsdp.reshard_after_forward is not False
        self.keep_for_backward = not fsdp.gather_once_per_update and keeps_gathered_for_backward(
            fsdp, mesh if train_mesh is None else train_mesh["dp"], device
        )
        self.gather_once = fsdp.gather_once_per_update
        assert is_meta(module) == (weights is not None), "a meta-built module needs its WeightPlan, and only it"
        if train_mesh is not None:
            assert tuple(train_mesh.mesh.flatten().tolist()) == tuple(mesh.mesh.flatten().tolist()), "one set of ranks"
            apply_tp(hf_model, tp_mesh=train_mesh["tp"])
        if expert_mesh is not None:
            assert train_mesh is None and tuple(expert_mesh.mesh.flatten().tolist()) == tuple(
                mesh.mesh.flatten().tolist()
            )
            apply_ep(module, ep_mesh=expert_mesh["ep"])
        if compiles_norms(fsdp, device):
            compile_norms(hf_model)
        if gradient_checkpointing:
            apply_ac(module, hf_model)
        apply_fsdp(
            module,
            hf_model,
            mesh=mesh if train_mesh is None else train_mesh["dp"],
            cfg=fsdp,
            device=device,
            expert_mesh=expert_mesh,
        )
        if train_mesh is not None:
            # after fully_shard: FSDP2's forward hooks see the group's outputs, ours then cut this rank's rows
            TPGroupRows(module, train_mesh["tp"].get_group())
        self.seq: SequenceParallel | None = None
        if sequence_mesh is not None:
            self.seq = apply_sp(module, hf_model, sp_mesh=sequence_mesh, mode=sequence_mode, train_mesh=train_mesh)
        if weights is not None:
            # FSDP2's CPU offload keeps the sharded parameters in host memory
            materialize(module, device=torch.device("cpu") if fsdp.cpu_offload else device)
            weights.load(module)
        if vision_blocks(hf_model):
            # FSDP2 decides which module is the root at the first forward. The colocated native rollout runs a vision
            # tower's blocks (FSDP units of their own) inside ``unsharded`` before the root's first forward: decide the
            # root now, as that forward would.
            module._get_fsdp_state()._lazy_init()
        self.module = module
        self.hf_model = hf_model
        if optim is None:
            module.eval()
            module.requires_grad_(False)
            self.optim = None
        else:
            module.train()
            if fused_optimizer is None:
                fused_optimizer = fsdp.fused_adamw if fsdp.fused_adamw is not None else True
            self.optim = Optimizer(
                [p for p in module.parameters() if p.requires_grad],
                optim,
                total_steps=total_optim_steps,
                fused=fused_optimizer,
            )
        # the torch objects, which checkpoint state reads (None when frozen)
        self.optimizer = self.optim.optimizer if self.optim else None
        self.scheduler = self.optim.scheduler if self.optim else None

    def fsdp_modules(self) -> Iterator[FSDPModule]:
        return (m for m in self.module.modules() if isinstance(m, FSDPModule))

    @property
    def lr(self) -> float:
        return self.optim.lr if self.optim else 0.0

    @property
    def fused_optimizer(self) -> bool:
        return self.optim is not None and self.optim.fused

    def optimizer_step(
        self, micro_batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor]
    ) -> UpdateStats:
        """Accumulate gradients over ``micro_batches`` (``loss_fn(module, mb).backward()`` each), clip, step; returns
        ``grad_norm`` and ``skipped`` (1.0 when the update was skipped) as 0-dim float64 tensors on the device.

        ``loss_fn`` must return the micro-batch's share of the globally-normalised loss. A non-finite gradient norm
        skips the update: on the fused path inside the optimiser kernel (no host sync), else after reading the norm.
        """
        assert self.optim is not None, "optimizer_step on a frozen engine"
        self.optim.zero_grad()
        with self._kept_for_backward():
            self._accumulate(micro_batches, loss_fn)
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.train_mesh is None and self.expert_mesh is None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.optim.max_norm)
        else:  # parameters on two meshes (2-D TP or EP weights, 1-D FSDP ones): norms per mesh, then clip's rule
            grad_norm = grad_norm_2d(params)
            scale = self.optim.clip_coef(grad_norm)
            for p in params:
                p.grad.mul_(scale)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        skipped = (~torch.isfinite(grad_norm)).float()
        self.optim.step(skipped)  # fused: skipped on the device, inside the kernel
        # float64, so that the metrics' arithmetic on them is what it was on Python floats
        return UpdateStats(grad_norm=grad_norm.detach().double(), skipped=skipped.double())

    def _accumulate(self, micro_batches: Iterable, loss_fn) -> None:
        """Every micro-batch's forward and backward: gradients accumulate in the parameters."""
        for mb, last in _with_last(micro_batches):
            if self.gather_once:
                self._keep_gathered(not last)
            if self.seq is None:
                loss_fn(self.module, mb).backward()
                continue
            for owner in range(self.seq.size):  # the SP group's turns: one member's rows at a time, split over all
                if owner == self.seq.rank:
                    loss_fn(self.module, mb).backward()
                else:
                    self.seq.follow(self.module, device=self.device).backward()

    @contextmanager
    def _kept_for_backward(self):
        """``keeps_gathered_for_backward``: within the block forwards do not reshard (backward does), and every unit is
        sharded again after it, whether or not its backward ran (a frozen vision tower's does not)."""
        if not self.keep_for_backward:
            yield
            return
        with self._no_reshard_after_forward(gather=False):
            yield

    @contextmanager
    def _no_reshard_after_forward(self, *, gather: bool):
        """Within the block no unit reshards after its forward (``gather``: every unit is gathered first); after it
        every unit is sharded and the configured resharding restored (FSDP2 keeps the root unsharded after forward, as
        it is gathered again for backward at once)."""
        mods = list(self.fsdp_modules())
        for m in mods:
            m.set_reshard_after_forward(False, recurse=False)
            if gather:
                m.unshard()
        try:
            yield
        finally:
            for m in mods:
                m.reshard()
                m.set_reshard_after_forward(self.reshard_after_forward and m is not self.module, recurse=False)

    def _keep_gathered(self, keep: bool) -> None:
        """``fsdp.gather_once_per_update``: before a micro-batch that is not the update's last (``keep``), its
        backward neither reshards the parameters nor reduce-scatters the gradients (FSDP2 accumulates them unsharded);
        the last one's does both, as every micro-batch's would otherwise."""
        for m in self.fsdp_modules():
            m.set_reshard_after_forward(
                False if keep else self.reshard_after_forward and m is not self.module, recurse=False
            )
            m.set_reshard_after_backward(not keep, recurse=False)
            m.set_requires_gradient_sync(not keep, recurse=False)

    @contextmanager
    def unsharded(self):
        """All parameters gathered in place for the duration (colocated rollout reads them, no copy).

        Module forwards inside the block do not re-gather or free parameters.
        """
        with self._no_reshard_after_forward(gather=True):
            yield self.module

    @contextmanager
    def gathered_hf_model(self) -> Iterator[nn.Module]:
        """The HF model inside the root module with every parameter gathered in place (``unsharded``)."""
        assert self.train_mesh is None and self.expert_mesh is None, (
            "tensor- or expert-parallel weights stay sharded in place: use weight_stream"
        )
        with self.unsharded():
            yield self.hf_model

    def weight_stream(self, dtype: torch.dtype) -> WeightStream:
        """The weights unit by unit as ``(HF name, full tensor)`` in ``dtype`` (``engines/weight_stream.py``)."""
        return WeightStream(self, dtype=dtype)

    def offload_params(self) -> None:
        """Move the sharded parameters to host memory (a frozen role between uses); ``load_params`` brings them back.

        FSDP2 supports ``Module.to`` on a sharded module (it re-registers the moved shards). Frozen roles have no
        gradients or optimizer state to move.
        """
        self.module.to("cpu")

    def load_params(self) -> None:
        self.module.to(self.device, non_blocking=True)

    def state_dict(self) -> dict:
        """Checkpoint state (``Stateful``): sharded model and optimiser state keyed by parameter name, and the
        LR schedule. DCP saves the shards and reshards them on load, so the world size may change."""
        assert self.optimizer is not None, "a frozen engine has no training state to checkpoint"
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "lr_scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["lr_scheduler"])

    def param_shapes(self) -> dict[str, torch.Size]:
        """Global (unsharded) shape of every entry of the model state dict, by name."""
        return {k: v.shape for k, v in get_model_state_dict(self.module).items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU state dict of the root module on rank 0 of the mesh; empty elsewhere."""
        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """``full_state_dict`` of the HF model alone, under its own names (the role wrapper's prefix stripped)."""
        prefix = next(name for name, m in self.module.named_modules() if m is self.hf_model)
        prefix = f"{prefix}." if prefix else ""
        return {k[len(prefix) :]: v for k, v in self.full_state_dict().items() if k.startswith(prefix)}
