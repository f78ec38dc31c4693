"""The FSDP2 engine's config component (``actor.engine:fsdp``, the default): its options and its ``build``, which
makes a role's module (meta-device and sharded-loaded, or loaded whole) and hands it to ``FSDPEngine``
(``engine.py``), or to ``LoraEngine`` (``lora.py``) for a policy training LoRA adapters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.engines.base import ModuleKind, TrainingEngine, TrainingEngineConfig
from rlspmd.engines.optim import OptimConfig
from rlspmd.models.loader import ModelConfig, dtype_name
from rlspmd.models.lora import LoraConfig

if TYPE_CHECKING:
    from torch import nn

    from rlspmd.models.sharded_load import WeightPlan

# The engines and model builders (transformers, torch.distributed.checkpoint: seconds of imports) load in ``build``:
# parsing a command line and checking a config import this module, and fail fast.


@dataclass
class FSDPConfig(TrainingEngineConfig):
    """The FSDP2 engine: ``fully_shard`` on each decoder layer, then the root; every feature (LoRA, ``mesh.actor_tp``,
    ``mesh.actor_sp``, CPU offload, packing). ``SFTConfig.fsdp`` is one too."""

    name: ClassVar[str] = "fsdp"
    supports_lora: ClassVar[bool] = True
    supports_mesh_tp: ClassVar[bool] = True
    supports_vision: ClassVar[bool] = True
    supports_moe: ClassVar[bool] = True
    supports_mesh_sp: ClassVar[bool] = True
    lends_weights: ClassVar[bool] = True
    vocab_outputs: ClassVar[bool] = True
    cpu_bf16: ClassVar[bool] = True
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of unsharded parameters (FSDP2 mixed precision: the sharded master weights, gradients and
    optimiser state stay in ``model.dtype``). ``auto``: bfloat16 on CUDA and on CPUs with hardware bfloat16
    (AVX512-BF16 or AMX: ``engines.base.native_bf16``), float32 on other CPUs, where bfloat16 is emulated and slower.
    The run's log says which it chose."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduce-scatter over two or more ranks. A one-rank group, which sums nothing, reduces in the
    compute dtype (the same numbers, fewer bytes; ``engines/fsdp/engine.py: mixed_precision``), except with
    ``gather_once_per_update``."""
    reshard_after_forward: bool | None = None
    """Free unsharded parameters after each layer's forward (ZeRO-3). False keeps them until backward (ZeRO-2-like).
    None: True, except within an update on CPU with one rank, where nothing is sharded and keeping each layer's
    compute-dtype copy until its backward saves casting it again (``engines/fsdp/engine.py:
    keeps_gathered_for_backward``)."""
    fused_adamw: bool | None = None
    """torch's fused AdamW (one kernel for all parameters; a non-finite gradient norm skips the update inside it).
    None: on, on CUDA and on CPU (with ``cpu_offload`` too, where the update runs on the host copy). On CPU it is 5x
    faster than torch's default per-parameter loop (0.09 s against 0.50 s for SmolLM2-135M's parameters on a 2-core
    Xeon) and rounds differently from it; False keeps the loop (foreach on CUDA)."""
    gather_once_per_update: bool = False
    """Within one optimiser step, gather each unit's parameters once and keep them, with their gradients unsharded
    (accumulated in ``reduce_dtype``), until the last micro-batch's backward, which reduce-scatters once: no re-gather
    and re-cast at every micro-batch's forward and backward, one reduce-scatter per step instead of one per
    micro-batch. Costs the whole model's unsharded parameters (compute dtype) and gradients (``reduce_dtype``) per rank
    for the update. Measured on CPU (one rank, SmolLM2-135M, 2 micro-batches): no faster; on GPUs, where the q05
    profile's update time went to re-gathering and re-casting, not measured yet."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU (FSDP2 CPUOffloadPolicy)."""
    compile_norms: bool | None = None
    """Run the language model's RMSNorm layers (each decoder layer's, q/k norms included, and the final one) through
    ``torch.compile``, for every role this engine builds (actor and reference, or the critic): a fused kernel each way
    instead of transformers' float32 upcast, square, mean, scale and downcast kernels (about twice as many in
    backward). None: on where the role computes in bfloat16 on CPU (``param_dtype``), off elsewhere (on GPUs it has
    not been measured). On CPU in bfloat16 those small kernels are a real share of the update: a SmolLM2-135M GRPO
    step on a 2-core Xeon, medians of 5 steps in 2 alternating pairs, update 3.01 / 3.37 s against 3.35 / 3.77 s,
    reference 0.62 / 0.68 s against 0.71 / 0.78 s, step 6.56 / 7.11 s against 7.19 / 7.43 s; the same log-probs in
    bfloat16. Costs a few seconds of compiling in a fresh process, and once more when the packed length first
    changes."""

    def params_on_host(self) -> bool:
        return self.cpu_offload

    def build(
        self,
        kind: ModuleKind,
        model_path: str,
        *,
        model: ModelConfig,
        mesh: DeviceMesh,
        device: torch.device,
        optim: OptimConfig | None,
        total_optim_steps: int = 1,
        gradient_checkpointing: bool = False,
        seed: int = 0,
        field_name: str,
        section: str,
        lora: LoraConfig | None = None,
        train_mesh: DeviceMesh | None = None,
        expert_mesh: DeviceMesh | None = None,
        sequence_mesh: DeviceMesh | None = None,
        sequence_mode: str = "auto",
        freeze_vision: bool = False,
    ) -> TrainingEngine:
        from rlspmd.engines.fsdp.engine import FSDPEngine
        from rlspmd.engines.fsdp.lora import LoraEngine
        from rlspmd.models.vision import freeze_vision_tower

        lora = lora if lora is not None and lora.enabled else None
        compute = self.compute_dtype(device)
        if optim is None and compute != torch.float32 and model.dtype == "float32":
            # A frozen role never updates its weights: it keeps them in the compute dtype, which is what mixed precision
            # would cast them to at every forward anyway (the same values, half the memory, no casts).
            model = dataclasses.replace(model, dtype=dtype_name(compute))
        module, weights = fsdp_role_module(kind, model_path, model=model, seed=seed, field_name=field_name, lora=lora)
        if freeze_vision:
            freeze_vision_tower(module.hf)
        kw = dict(
            mesh=mesh,
            device=device,
            fsdp=self,
            optim=optim,
            total_optim_steps=total_optim_steps,
            gradient_checkpointing=gradient_checkpointing,
            weights=weights,
        )
        if train_mesh is not None:
            kw["train_mesh"] = train_mesh
        if expert_mesh is not None:
            kw["expert_mesh"] = expert_mesh
        if sequence_mesh is not None:
            kw.update(sequence_mesh=sequence_mesh, sequence_mode=sequence_mode)
        if lora is not None:
            return LoraEngine(module, module.hf, lora=lora, **kw)
        return FSDPEngine(module, module.hf, **kw)


def fsdp_role_module(
    kind: ModuleKind,
    model_path: str,
    *,
    model: ModelConfig,
    seed: int = 0,
    field_name: str,
    lora: LoraConfig | None = None,
) -> tuple[nn.Module, WeightPlan | None]:
    """A role module for the FSDP engine: built on the meta device with the plan of where its weights come from
    (``model.sharded_load``: the engine parallelises it, then each rank reads its slices), or loaded whole (None).
    ``lora``: a policy with LoRA adapters (initialised from ``seed``)."""
    from rlspmd.models.lora import apply_lora, initial_adapters
    from rlspmd.models.sharded_load import (
        build_policy_module,
        meta_policy_module,
        meta_sequence_scorer,
        meta_value_model,
    )
    from rlspmd.models.value import load_sequence_scorer, load_value_model

    kw = dict(
        dtype=model.dtype,
        attn_implementation=model.attn_implementation,
        field_name=field_name,
        packing=model.packing,
        attn_kernel=model.attn_kernel,
    )
    if model.sharded_load:
        if kind == "policy":
            module, plan = meta_policy_module(model_path, lora=lora, seed=seed, **kw)
            module.share_prompts = model.share_prompts
            return module, plan
        return (
            meta_value_model(model_path, seed=seed, **kw) if kind == "value" else meta_sequence_scorer(model_path, **kw)
        )
    if kind == "policy":
        module = build_policy_module(model_path, **kw)
        module.share_prompts = model.share_prompts
        if lora is not None and lora.enabled:
            apply_lora(module.hf, lora)
            with torch.no_grad():
                params = dict(module.named_parameters())
                for name, value in initial_adapters(module, seed=seed).items():
                    params[name].copy_(value)
        return module, None
    return (
        load_value_model(model_path, seed=seed, **kw) if kind == "value" else load_sequence_scorer(model_path, **kw)
    ), None
