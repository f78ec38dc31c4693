"""The FSDP2 engine of a LoRA policy (``actor.lora.rank`` > 0), and the reference that reads the same weights.

``LoraEngine`` is ``FSDPEngine`` over a policy whose HF model carries peft LoRA layers (``models/lora.py``): the base
weights are frozen and sharded like any FSDP2 parameter, the adapters are the only trainable parameters, so AdamW
holds state for them alone and gradients are reduced for them alone. What differs from full fine-tuning:

* **Checkpoint state** is the adapters and their optimiser state (DCP with ``ignore_frozen_params``); the base
  weights come from the model directory again on resume.
* **The rollout** sees the adapters merged: ``gathered_hf_model`` (the colocated native engine reads the gathered
  weights in place) adds ``scaling * B @ A`` to each gathered base weight and switches the adapters off for the
  duration; FSDP2's gathered parameters are copies, freed at reshard, so the sharded base weights never change.
  ``weight_stream`` (vLLM, a private copy, split placement) hands out merged weights under the checkpoint's names.
  Merging once per generation was measured against applying the adapters at every decoded token
  (``scripts/bench/lora_generate.py``; docs/lora.md).
* **The reference** is the same engine with the adapters switched off (``base_model``): no second copy of the model.
* **Export** (``hf_state_dict``) is the merged model; ``adapter_state_dict`` the adapters under HF names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from rlspmd.models.lora import LoraConfig
from rlspmd.engines.fsdp.engine import FSDPEngine
from rlspmd.engines.weight_stream import WeightStream
from rlspmd.models.lora import adapters_disabled, is_adapter, merge_in_place, merge_lora, scaling

ADAPTERS_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
"""DCP keeps a tied alias of a frozen weight (``lm_head.weight``) even with ``ignore_frozen_params``: the state dicts
are filtered to the adapters by name as well (``_adapters``), and loading is not strict about the frozen rest."""


class LoraEngine(FSDPEngine):
    def __init__(self, module: nn.Module, hf_model: nn.Module, *, lora: LoraConfig, **kw):
        """``module`` already carries the adapters (``fsdp_role_module(..., lora=...)``); ``kw``: ``FSDPEngine``'s."""
        super().__init__(module, hf_model, **kw)
        self.lora = lora
        self.scaling = scaling(hf_model)
        assert self.optimizer is not None, "a LoRA engine trains its adapters"

    @contextmanager
    def gathered_hf_model(self) -> Iterator[nn.Module]:
        """The HF model, gathered in place, with the adapters merged into the gathered base weights and switched off."""
        with self.unsharded(), adapters_disabled(self.hf_model):
            merge_in_place(self.hf_model)
            yield self.hf_model

    def weight_stream(self, dtype: torch.dtype) -> WeightStream:
        """Merged weights under the checkpoint's HF names, unit by unit (the merge runs on every rank, per unit)."""
        return WeightStream(self, dtype=dtype, lora_scaling=self.scaling)

    def base_model(self) -> "BaseModelView":
        """The frozen reference: this engine's weights with the adapters off."""
        return BaseModelView(self)

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=ADAPTERS_ONLY)
        return {"model": _adapters(model_sd), "optim": optim_sd, "lr_scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=ADAPTERS_ONLY,
        )
        self.scheduler.load_state_dict(state["lr_scheduler"])

    def param_shapes(self) -> dict[str, torch.Size]:
        """The adapters' global shapes: what a LoRA checkpoint holds."""
        return {k: v.shape for k, v in _adapters(get_model_state_dict(self.module, options=ADAPTERS_ONLY)).items()}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The merged model under the checkpoint's HF names, on the mesh's first rank (empty elsewhere); collective."""
        full = super().hf_state_dict()
        return dict(merge_lora(full.items(), self.scaling)) if full else {}

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters under HF names (``model.layers.0.self_attn.q_proj.lora_A.default.weight``), on the mesh's first
        rank (empty elsewhere); collective."""
        return {k: v for k, v in super().hf_state_dict().items() if is_adapter(k)}


def _adapters(model_sd: dict) -> dict:
    return {k: v for k, v in model_sd.items() if is_adapter(k)}


class _AdaptersOff(nn.Module):
    """Calls the LoRA policy module with its adapters switched off."""

    def __init__(self, module: nn.Module, hf_model: nn.Module):
        super().__init__()
        # plain attributes, not submodules: the view must not own (or re-register) the actor's parameters
        object.__setattr__(self, "inner", module)
        object.__setattr__(self, "hf_model", hf_model)

    def forward(self, *args, **kwargs):
        with adapters_disabled(self.hf_model):
            return self.inner(*args, **kwargs)


class BaseModelView:
    """What the reference role needs from an engine (``module``, ``mesh``, ``device``), over the LoRA actor's engine
    with the adapters off. The weights are the actor's, sharded once: nothing to offload."""

    def __init__(self, engine: LoraEngine):
        self.mesh, self.device = engine.mesh, engine.device
        self.module = _AdaptersOff(engine.module, engine.hf_model)

    def offload_params(self) -> None:
        raise RuntimeError("the LoRA reference reads the actor's weights; it cannot be offloaded (ref.offload)")

    def load_params(self) -> None:
        raise RuntimeError("the LoRA reference reads the actor's weights; it cannot be offloaded (ref.offload)")
