"""``MegatronEngine``: the FSDP engine's surface (``rlspmd.engines.base.TrainingEngine``) over a megatron role module
(``modules.py``, built by the trainer's builder and handed here, as the FSDP engine is handed its module).

**Update.** An update goes through megatron's forward-backward contract: ``forward_step`` runs the stage and, on the
last stage, a loss function that calls ``loss_fn`` for each pipeline member's micro-batch (gathered to the last stage
beforehand) and sums them. CUDA runs megatron's 1F1B schedule; CPU a GPipe schedule over Gloo
(``rlspmd.engines.pipeline``: megatron's p2p code allocates on CUDA). Gradients are then summed (not averaged) over the
DP group: losses are already normalised by the global batch (``rlspmd.algorithms.aggregation``), as in the FSDP
engine. The optimiser (AdamW on each rank's shard, replicated over DP; ``engines/optim.py``) is the FSDP engine's.

**Checkpoints** hold the weights and AdamW state under the *Hugging Face* names of the FSDP engine's root module
(``hf.model.layers.0.self_attn.q_proj.weight``, ...), each TP shard a ``DTensor`` piece of the HF tensor: DCP
reshards between TP degrees, and ``scripts/export_hf.py`` reads a megatron checkpoint as it reads an FSDP one. With
pipeline stages each stage saves its own tensors (the tied embedding's two copies under one name, identical).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rlspmd.engines.optim import OptimConfig
from rlspmd.distributed.micro_batches import zero_weight_copy
from rlspmd.engines.base import UpdateStats
from rlspmd.engines.megatron.modules import LastStageModule, MegatronModule, ZeroOutputs, stage_forward
from rlspmd.engines.megatron.packing import GroupRows, front_pack, gather_front_packed
from rlspmd.engines.megatron.weight_stream import MegatronWeightStream, full_units
from rlspmd.engines.optim import Optimizer
from rlspmd.models import megatron_convert as mc


class MegatronEngine:
    """A megatron role module (this rank's stage and TP shard) with, for trained roles, its optimiser.

    ``module``: from ``build_megatron_module`` (``modules.py``); ``mesh``: the role's mesh it was built over (the
    data's: loss counts, micro-batch counts, metrics). Frozen roles (reference) pass ``optim=None``."""

    def __init__(
        self, module: MegatronModule, *, mesh: DeviceMesh, optim: OptimConfig | None, total_optim_steps: int = 1
    ):
        from third_party import megatron_adapter as ma  # lazily: megatron-core is optional (the module imported it)

        self.ma, self.module, self.mesh, self.device = ma, module, mesh, module.device
        self.groups = module.groups
        trainable = [p for _, p in module.params]
        if optim is None:
            module.model.eval()
            for p in trainable:
                p.requires_grad_(False)
            self.optim = None
        else:
            module.model.train()
            self.optim = Optimizer(trainable, optim, total_steps=total_optim_steps)
        # the torch objects (None when frozen)
        self.optimizer = self.optim.optimizer if self.optim else None
        self.scheduler = self.optim.scheduler if self.optim else None

    # -- training --

    @property
    def lr(self) -> float:
        return self.optim.lr if self.optim else 0.0

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
        assert self.optim is not None, "optimizer_step on a frozen engine"
        self.optim.zero_grad()
        module, g = self.module, self.groups
        micro = list(micro_batches)
        ones = torch.ones((), dtype=torch.int, device=self.device)
        if g.pp == 1:

            def forward_step(data_iterator, model):
                loss = loss_fn(module, next(data_iterator))
                return loss, lambda out: (out, ones, {})  # (loss, token count, logged): used as returned

            data = iter(micro)
        else:

            def forward_step(data_iterator, model):
                rows, column = next(data_iterator)
                hidden = stage_forward(module, rows)
                if not g.last_stage:  # what megatron's p2p receives into (config.pipeline_dtype)
                    hidden = hidden.to(module.pipeline_dtype)

                def loss_func(hidden_WNH):  # called on the last stage only
                    loss = sum(loss_fn(LastStageModule(module, hidden_WNH, rows, j), mb) for j, mb in enumerate(column))
                    return loss, ones, {}

                return hidden, loss_func

            data = iter(self._pipeline_micro_batches(micro))
        self.ma.forward_backward(
            forward_step,
            data,
            model=module.model,
            num_micro_batches=len(micro),
            pg_collection=module.pg_collection,
            device=self.device,
            pipeline_dtype=module.pipeline_dtype,
        )
        if g.pp > 1 and not g.last_stage:
            # Metrics are reduced over ranks by name, so every rank must record the same names: record this rank's
            # with zero weight, as a zero-weight filler micro-batch does (the values are on the last stage).
            with torch.no_grad():
                loss_fn(ZeroOutputs(module), zero_weight_copy(micro[0]))
        grads = self._sum_grads()
        grad_norm = self._global_grad_norm(grads)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            torch._foreach_mul_(grads, self.optim.clip_coef(grad_norm))  # the global norm's clipping factor
        self.optim.step(skipped)
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
        params = self.module.params
        for _, p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.groups.embd_group is not None:
            tied = params[0][1] if self.groups.first_stage else dict(params)["output_layer.weight"]
            dist.all_reduce(tied.grad, group=self.groups.embd_group)
        grads = [p.grad for _, p in params]
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
        for (name, _), grad in zip(self.module.params, grads):
            if name == "output_layer.weight" and self.module.has_tied_copy:
                continue
            if g.tp_rank == 0 or self.module.tp_sharded(name):
                sq += torch.linalg.vector_norm(grad.float()) ** 2
        if g.tp * g.pp > 1:
            dist.all_reduce(sq, group=g.mp_group)
        return float(sq.sqrt())

    # -- checkpoints --

    def _distributed(self, hf_name: str, piece: torch.Tensor) -> torch.Tensor:
        """A piece as DCP must see it: a ``DTensor`` shard of the HF tensor over the TP group, or (replicated, or
        ``tp`` 1) the plain tensor, identical on every rank that holds it."""
        dim = None if hf_name.startswith("value_head.") else mc.hf_shard_dim(hf_name)
        if self.groups.tp == 1 or dim is None:
            return piece.detach().clone()
        return DTensor.from_local(piece.detach().contiguous(), self.groups.tp_mesh, [Shard(dim)], run_check=False)

    def _tied_head_alias(self) -> tuple[str, str] | None:
        """(``lm_head.weight``, the embedding) under root-module names when the HF model lists its tied head too."""
        if not self.module.tied_lm_head:
            return None
        return self.module.root_name("lm_head.weight"), self.module.root_name("model.embed_tokens.weight")

    def state_dict(self) -> dict:
        """Checkpoint state (``Stateful``) in the FSDP engine's layout and names: ``model`` (root-module names, the
        tied ``lm_head.weight`` listed too), ``optim`` (``state`` per parameter name, ``param_groups``), and
        ``lr_scheduler``. Tensors are this rank's pieces (``_distributed``); nothing is gathered."""
        assert self.optim is not None, "a frozen engine has no training state to checkpoint"
        self.optim.init_state()
        m = self.module
        model, optim_state, names = {}, {}, []
        for name, p in m.params:
            st = self.optimizer.state[p]
            moments = {k: m.hf_pieces(name, st[k]) for k in ("exp_avg", "exp_avg_sq")}
            for i, (hf, piece) in enumerate(m.hf_pieces(name, p)):
                root = m.root_name(hf)
                names.append(root)
                model[root] = self._distributed(hf, piece)
                optim_state[root] = {
                    "step": st["step"].clone(),
                    **{k: self._distributed(hf, moments[k][i][1]) for k in moments},
                }
        alias = self._tied_head_alias()
        if alias is not None and alias[1] in model:
            model[alias[0]] = model[alias[1]]
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return {
            "model": model,
            "optim": {"state": optim_state, "param_groups": [{**group, "params": names}]},
            "lr_scheduler": self.scheduler.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.optim.init_state()
        m = self.module
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        for name, p in m.params:
            hf_names = [hf for hf, _ in m.hf_pieces(name, p)]
            p.copy_(m.join(name, [local(state["model"][m.root_name(h)]) for h in hf_names]))
            saved = [state["optim"]["state"][m.root_name(h)] for h in hf_names]
            st = self.optimizer.state[p]
            st["step"].copy_(saved[0]["step"])
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(m.join(name, [local(s[k]) for s in saved]))
        for k in ("lr", "initial_lr"):
            self.optimizer.param_groups[0][k] = state["optim"]["param_groups"][0][k]
        self.scheduler.load_state_dict(state["lr_scheduler"])

    def param_shapes(self) -> dict[str, torch.Size]:
        """Global shape of every entry of the model state dict, by (root-module HF) name: every stage's entries."""
        m = self.module
        shapes = {m.root_name(hf): torch.Size(shape) for _, specs, _ in m.global_units() for hf, shape in specs}
        alias = self._tied_head_alias()
        if alias is not None:
            shapes[alias[0]] = shapes[alias[1]]
        return shapes

    # -- full weights: export and rollout --

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict under the FSDP root module's names on rank 0 of the mesh; empty elsewhere. Collective."""
        main = self.mesh.get_local_rank() == 0
        out = {}
        for _, tensors in full_units(self.module, self.module.params[0][1].dtype):
            if main:
                out.update((self.module.root_name(hf), t.to("cpu", copy=True)) for hf, t in tensors)
        alias = self._tied_head_alias()
        if main and alias is not None:
            out[alias[0]] = out[alias[1]]
        return out

    @property
    def hf_model(self) -> nn.Module:
        """The HF model of this architecture on the meta device (``TrainingEngine.hf_model``)."""
        return self.module.hf_model

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """``full_state_dict`` under the HF model's own names (the role wrapper's ``hf.`` prefix stripped)."""
        return {k.removeprefix("hf."): v for k, v in self.full_state_dict().items() if k.startswith("hf.")}

    def weight_stream(self, dtype: torch.dtype) -> MegatronWeightStream:
        return MegatronWeightStream(self.module, mesh=self.mesh, dtype=dtype)

    def offload_params(self) -> None:
        """Move the parameters to host memory (a frozen role between uses); ``load_params`` brings them back."""
        self.module.model.to("cpu")

    def load_params(self) -> None:
        self.module.model.to(self.device, non_blocking=True)
