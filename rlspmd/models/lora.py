"""LoRA adapters on the policy's Hugging Face model, through ``peft``: injection, initialisation, merging, peft export.

``apply_lora`` injects peft's LoRA layers into the target linear layers of the HF model in place
(``peft.inject_adapter_in_model``: no ``PeftModel`` wrapper, so the role modules and the FSDP2 units are unchanged)
and freezes everything else. A target ``q_proj`` becomes a ``peft`` ``lora.Linear`` whose base weights are
``q_proj.base_layer.weight`` and whose adapters are ``q_proj.lora_A.default.weight`` (r x in) and
``q_proj.lora_B.default.weight`` (out x r); its output is ``base(x) + scaling * B A x`` with ``scaling = alpha / r``.

The adapters' initial values are drawn here (``initial_adapters``), not by peft: A from peft's default
(``kaiming_uniform_(a=sqrt(5))``, i.e. U(-1/sqrt(in), 1/sqrt(in))), B zeros, with a generator seeded by the run's seed,
parameter by parameter in model order, so every rank and both load paths (meta or ``from_pretrained``) start from the
same adapters, and the initial policy equals the base model exactly (B = 0).

Merging (``merged_weight``) is ``W + scaling * B @ A`` computed in float32. It serves the rollout (``merge_lora`` on a
weight stream: vLLM or a private copy receives plain HF weights) and export (a merged HF directory next to the peft
adapter, ``peft_adapter_state``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn


@dataclass
class LoraConfig:
    """LoRA fine-tuning of the policy through ``peft`` (``rank`` > 0): only the adapters train, are sharded with the
    model and have optimiser state; the reference is the base model (the adapters switched off: no second copy of the
    weights); the rollout generates with the adapters merged; checkpoints hold the adapters and their optimiser
    state; ``scripts/export_hf.py`` writes a merged model and the peft adapter."""

    rank: int = 0
    """Adapter rank r; 0 trains every weight (no LoRA)."""
    alpha: float = 16.0
    """Scaling numerator: an adapter adds ``alpha / rank * B A x`` to its layer's output."""
    dropout: float = 0.0
    """Dropout on the adapters' input in every actor forward that runs in training mode (the log-prob passes of the
    update included, so keep 0 for exact PPO ratios)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Layers that get adapters, by name suffix (``q_proj``, ``v_proj``, ...), or ``all-linear`` (peft: every linear
    layer except the LM head)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


ADAPTER = "default"
"""peft's adapter name: the one adapter a policy trains."""
BASE = ".base_layer."
LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def peft_config(cfg: LoraConfig, *, base_model: str | None = None, target_modules=None):
    """``peft.LoraConfig`` for ``actor.lora`` (``target_modules``: the resolved module names, for export)."""
    import peft

    targets = target_modules or (
        cfg.target_modules[0] if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    )
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def apply_lora(hf_model: nn.Module, cfg: LoraConfig, *, field_name: str = "actor.lora.target_modules") -> None:
    """Inject LoRA adapters into ``hf_model``'s target layers and freeze every other parameter."""
    import peft

    try:
        peft.inject_adapter_in_model(peft_config(cfg), hf_model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"{field_name}={cfg.target_modules}: {e}") from None
    for name, p in hf_model.named_parameters():
        p.requires_grad_(is_adapter(name))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The injected LoRA layers, ``(name, layer)`` in model order."""
    from peft.tuners.lora import LoraLayer

    return ((n, m) for n, m in module.named_modules() if isinstance(m, LoraLayer))


def scaling(module: nn.Module) -> float:
    """``alpha / r``, the same for every layer (no per-layer rank or alpha patterns)."""
    values = {m.scaling[ADAPTER] for _, m in lora_layers(module)}
    assert len(values) == 1, f"one LoRA scaling expected, got {values}"
    return values.pop()


def initial_adapters(module: nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """``{parameter name: initial value}`` of every adapter of ``module`` (float32): A ~ U(-1/sqrt(in), 1/sqrt(in))
    (peft's kaiming-uniform default), B = 0, drawn in model order from a generator seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in module.named_parameters():
        if name.endswith(LORA_A):
            bound = 1.0 / math.sqrt(p.shape[1])
            out[name] = torch.rand(tuple(p.shape), generator=g).mul_(2 * bound).sub_(bound)
        elif name.endswith(LORA_B):
            out[name] = torch.zeros(tuple(p.shape))
    return out


@contextmanager
def adapters_disabled(hf_model: nn.Module) -> Iterator[None]:
    """Forwards inside run the base model (peft's ``enable_adapters(False)`` on every LoRA layer)."""
    layers = [m for _, m in lora_layers(hf_model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """``base + s * b @ a`` in float32, returned in ``base``'s dtype."""
    return (base.float() + (b.float() @ a.float()).mul_(s)).to(base.dtype)


@torch.no_grad()
def merge_in_place(hf_model: nn.Module) -> None:
    """Add every adapter's delta to its base weight, in place. Only on weights that are thrown away afterwards (the
    FSDP2-gathered copies a colocated rollout reads): the sharded base weights never change."""
    for _, m in lora_layers(hf_model):
        w = m.base_layer.weight
        w.copy_(merged_weight(w, m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight, m.scaling[ADAPTER]))


def merge_lora(pairs: Iterable[tuple[str, torch.Tensor]], s: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of one FSDP unit with LoRA layers -> plain HF weights: each ``x.base_layer.weight`` merged
    with ``x.lora_A/B`` (``merged_weight``) and named ``x.weight``, ``x.base_layer.bias`` named ``x.bias``; adapters
    dropped. A unit's tensors are held until its last one arrives (an adapter follows its base weight)."""
    unit = dict(pairs)
    for name, t in unit.items():
        if is_adapter(name):
            continue
        if name.endswith(BASE + "weight"):
            prefix = name[: -len(BASE + "weight")]
            yield f"{prefix}.weight", merged_weight(t, unit[prefix + LORA_A], unit[prefix + LORA_B], s)
        else:
            yield name.replace(BASE, "."), t


def base_name(name: str) -> str:
    """A base weight's name in the HF checkpoint (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(BASE, ".")


def peft_adapter_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of an HF-named state dict under peft's saved names (``base_model.model.<name>.lora_A.weight``),
    what ``PeftModel.from_pretrained`` reads from ``adapter_model.safetensors``."""
    return {f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": v for k, v in hf_state.items() if is_adapter(k)}


def target_module_names(hf_state: Iterable[str]) -> list[str]:
    """The adapted layers' short names (``q_proj``, ...), for the exported ``adapter_config.json``."""
    return sorted({k[: k.index(".lora_A.")].rsplit(".", 1)[-1] for k in hf_state if ".lora_A." in k})


def write_peft_adapter(hf_state: dict[str, torch.Tensor], cfg: LoraConfig, out: str | Path, *, base_model: str) -> Path:
    """``adapter_config.json`` and ``adapter_model.safetensors`` in peft's format (loads with
    ``PeftModel.from_pretrained``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_config(cfg, base_model=base_model, target_modules=target_module_names(hf_state)).save_pretrained(str(out))
    tensors = {k: v.detach().contiguous() for k, v in peft_adapter_state(hf_state).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
