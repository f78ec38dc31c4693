"""The megatron-core engine's config component (``actor.engine:megatron``): its layout and its ``build``. Reading it
needs no megatron-core (``build`` imports the engine, which imports megatron through ``third_party`` lazily)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.components import Problem
from rlspmd.engines.base import ModuleKind, TrainingEngine, TrainingEngineConfig

if TYPE_CHECKING:
    from rlspmd.engines.optim import OptimConfig
    from rlspmd.models.loader import ModelConfig
    from rlspmd.models.lora import LoraConfig


@dataclass
class MegatronConfig(TrainingEngineConfig):
    """The megatron-core engine (``engine=MegatronConfig(...)``; needs the ``megatron`` extra) and its layout.

    The role's ranks form a (pp, dp, tp) grid, tp fastest (megatron's default order): ``dp = ranks / (tp * pp)``.
    The trainer still hands every rank its own samples; the ``tp x pp`` ranks of a model replica run each
    micro-batch on their samples together and each keeps its own rows of the outputs. A reward model (a frozen
    sequence scorer) runs on the FSDP engine with its defaults."""

    name: ClassVar[str] = "megatron"
    tp: int = 1
    """Tensor-parallel degree (consecutive ranks). Must divide the model's KV heads, vocabulary and FFN size."""
    pp: int = 1
    """Pipeline-parallel degree: stages of consecutive layers (must divide the model's layers). The loss runs on the
    last stage; megatron's 1F1B schedule on CUDA, a GPipe schedule on CPU (docs/megatron.md)."""
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of forwards (autocast; parameters and optimiser state stay in ``model.dtype``). ``auto``: bfloat16
    on CUDA, float32 on CPU."""

    def problems(self) -> list[Problem]:
        return [(name, v, "must be >= 1") for name, v in (("tp", self.tp), ("pp", self.pp)) if v < 1]

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
        assert train_mesh is None and (lora is None or not lora.enabled), "rlspmd.validate: fsdp-only features"
        assert expert_mesh is None, "rlspmd.validate: expert parallelism needs supports_moe"
        assert sequence_mesh is None, "rlspmd.validate: sequence parallelism needs supports_mesh_sp"
        assert not freeze_vision, "rlspmd.validate: vision-language models need supports_vision"
        if kind == "scorer":
            from rlspmd.engines.fsdp import FSDPConfig

            fsdp = FSDPConfig()
            return fsdp.build(
                kind,
                model_path,
                model=model,
                mesh=mesh,
                device=device,
                optim=optim,
                field_name=field_name,
                section=section,
            )
        from rlspmd.engines.megatron.engine import MegatronEngine
        from rlspmd.engines.megatron.modules import build_megatron_module

        if gradient_checkpointing:
            raise ValueError(
                f"{section}: gradient_checkpointing=True is not supported with {section}.engine:megatron yet"
            )
        module = build_megatron_module(
            kind,
            model_path,
            mesh=mesh,
            device=device,
            cfg=self,
            dtype=model.dtype,
            seed=seed,
            field_name=field_name,
            field_prefix=f"{section}.engine",
        )
        return MegatronEngine(module, mesh=mesh, optim=optim, total_optim_steps=total_optim_steps)
