"""The FSDP2 training engine: ``engine.py`` (``FSDPEngine``: tensor parallel, activation checkpointing and FSDP2
applied in torchtitan's order; the optimiser step), ``lora.py`` (``LoraEngine``: LoRA adapters only) and
``config.py`` (``FSDPConfig``: the options and the ``build`` that makes a role's module and its engine)."""

from rlspmd.engines.fsdp.config import FSDPConfig, fsdp_role_module
from rlspmd.utils.imports import lazy_exports

_LAZY = {name: "engine" for name in ("FSDPEngine", "apply_ac", "apply_fsdp", "apply_tp", "check_tp")} | {
    "LoraEngine": "lora"
}
"""Loaded on first use (PEP 562): importing the config (to parse or check one) does not import the engine."""

__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = ["FSDPConfig", "fsdp_role_module", *_LAZY]
