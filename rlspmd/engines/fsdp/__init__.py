"""The FSDP2 training engine: ``engine.py`` (``FSDPEngine``: tensor parallel, activation checkpointing and FSDP2
applied in torchtitan's order; the optimiser step), ``lora.py`` (``LoraEngine``: LoRA adapters only) and
``config.py`` (``FSDPConfig``: the options and the ``build`` that makes a role's module and its engine)."""

from rlspmd.engines.fsdp.config import FSDPConfig, fsdp_role_module
from rlspmd.engines.fsdp.engine import FSDPEngine, apply_ac, apply_fsdp, apply_tp, check_tp
from rlspmd.engines.fsdp.lora import LoraEngine

__all__ = [
    "FSDPConfig",
    "FSDPEngine",
    "LoraEngine",
    "apply_ac",
    "apply_fsdp",
    "apply_tp",
    "check_tp",
    "fsdp_role_module",
]
