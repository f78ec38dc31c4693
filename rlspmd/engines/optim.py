"""The optimiser of a trained role, one component for both engines (``engines/fsdp``, ``engines/megatron``): AdamW
from ``OptimConfig``, its LR schedule (warmup, then constant / cosine / linear decay) and gradient clipping's rule.

The engine computes the global gradient norm, because that depends on how it lays the parameters out (FSDP2 shards
and 2-D TP DTensors, megatron's TP/PP pieces); what follows from the norm is decided here once: the clipping factor
(``torch.nn.utils.clip_grad_norm_``'s), skipping an update whose norm is not finite, stepping the schedule.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimiser steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warmup; cosine/linear decay to ``min_lr_ratio * lr`` at ``total_optim_steps``."""
    min_lr_ratio: float = 0.0
    """Final LR as a fraction of ``lr`` for decaying schedules."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (<= 0 disables clipping)."""


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return fn


def build_adamw(params: list[nn.Parameter], cfg: OptimConfig, *, fused: bool) -> torch.optim.AdamW:
    """AdamW over ``params``: ``fused=True`` (torch's single-kernel implementation, which also accepts FSDP2's DTensor
    shards) when asked and supported, else foreach where ``fused`` was asked (one kernel per op for all tensors), else
    torch's default for the device (CPU: the per-parameter loop, what every CPU figure here was measured with)."""
    kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if not fused:
        return torch.optim.AdamW(params, **kw)
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except RuntimeError as e:  # torch refuses fused for the parameters' device or dtype
        warnings.warn(f"fused AdamW is not supported here ({e}); using foreach", stacklevel=2)
        return torch.optim.AdamW(params, foreach=True, **kw)


class Optimizer:
    """AdamW over a role's trainable parameters with its LR schedule (``total_steps`` optimiser steps).

    ``optimizer`` and ``scheduler`` are the torch objects (checkpoint state reads them). An engine's update is
    ``zero_grad``, backward passes, the engine's global gradient norm, ``clip_coef`` applied to the gradients, ``step``.
    """

    def __init__(self, params: list[nn.Parameter], cfg: OptimConfig, *, total_steps: int, fused: bool = False):
        """``fused``: torch's fused AdamW (see ``build_adamw``)."""
        self.cfg = cfg
        self.optimizer = build_adamw(params, cfg, fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_steps))

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def fused(self) -> bool:
        return bool(self.optimizer.defaults["fused"])

    @property
    def max_norm(self) -> float:
        """``grad_clip``; infinite (no clipping) when it is not positive."""
        return self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_coef(self, grad_norm: torch.Tensor | float) -> torch.Tensor | float:
        """The factor the gradients are scaled by, ``clip_grad_norm_``'s ``min(max_norm / (norm + 1e-6), 1)``: a 0-dim
        tensor for a tensor norm (no host sync), a float for a float; 1 when clipping is off."""
        coef = self.max_norm / (grad_norm + 1e-6)
        return torch.clamp(coef, max=1.0) if isinstance(coef, torch.Tensor) else min(coef, 1.0)

    def step(self, skipped: torch.Tensor | bool) -> None:
        """Apply the update unless ``skipped`` (the gradient norm was not finite), then advance the LR schedule.

        On the fused path ``skipped`` (a float tensor) stays on the device: GradScaler's protocol, the kernel leaves
        parameters, moments and step count untouched when ``found_inf`` is non-zero. Elsewhere a skipped update drops
        the gradients."""
        if self.fused:
            self.optimizer.found_inf = skipped
            self.optimizer.step()
        elif bool(skipped):
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
        self.scheduler.step()

    def init_state(self) -> None:
        """AdamW's per-parameter state, created as its first step would (zeros), so a checkpoint can load into it
        before any update (an engine that builds its own optimiser state dict)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
