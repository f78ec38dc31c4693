"""KL regularisation toward the reference policy: per-token estimators, coefficient controllers, KL-in-reward.

All estimators are per token, from the log-probabilities of the SAMPLED tokens under the policy (`logprobs_BT`) and
the reference (`ref_logprobs_BT`); with x ~ pi and r = pi_ref(x) / pi(x) (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html):

| kind                           | value                       | note                                     |
|--------------------------------|-----------------------------|------------------------------------------|
| `k1`, alias `kl`               | log pi - log pi_ref         | unbiased for KL(pi || pi_ref), can be < 0 |
| `abs`                          | abs(log pi - log pi_ref)    |                                          |
| `k2`, alias `mse`              | 0.5 (log pi - log pi_ref)^2 | biased, low variance, >= 0               |
| `k3`, alias `low_var_kl`       | r - log r - 1               | unbiased, >= 0; clamped to [-10, 10]     |
| any of the above + `+`         | value of that kind          | gradient of k2 (straight-through)        |

The names are verl's (`kl_penalty` in `verl/trainer/ppo/core_algos.py`), so a config written for verl's
`kl_loss_type` / `kl_penalty` works unchanged: `kl`, `abs`, `mse`, `low_var_kl`, `k1`..`k3` and every `+` form
(`kl+`, `abs+`, `mse+`, `low_var_kl+`, `k1+`, `k2+`, `k3+`).

Why the "+" variants: used as a LOSS, the gradient of an unbiased KL *value* estimate is generally not an unbiased
estimate of the KL *gradient* (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL",
arXiv 2506.09477). For on-policy samples, grad k2 = (log pi - log pi_ref) * grad log pi, which is the per-token
score-function estimate of grad KL(pi || pi_ref). The "+" kinds therefore return `value.detach() + k2 - k2.detach()`:
the logged value is the chosen estimator's, the gradient is k2's (verl's `kl_loss_type` "+" suffix does the same).

k3: the log-ratio is clamped to [-20, 20] before `exp` so that it cannot overflow, and the result is clamped to
[-10, 10] as is common (k3 >= 0, so only the upper bound ever acts; where it acts the gradient is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from rlspmd.components import Component, Problem, Registry


def _k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    return logprobs_BT - ref_logprobs_BT


def _abs(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    return (logprobs_BT - ref_logprobs_BT).abs()


def _k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    return 0.5 * (logprobs_BT - ref_logprobs_BT).square()


def _k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    log_r_BT = (ref_logprobs_BT - logprobs_BT).clamp(-20.0, 20.0)
    return (log_r_BT.exp() - log_r_BT - 1.0).clamp(-10.0, 10.0)


def _with_k2_gradient(estimator: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    def straight_through(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
        k2_BT = _k2(logprobs_BT, ref_logprobs_BT)
        return estimator(logprobs_BT, ref_logprobs_BT).detach() + (k2_BT - k2_BT.detach())

    straight_through.__name__ = f"{estimator.__name__}_with_k2_gradient"
    return straight_through


_BASE_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}

KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    **_BASE_ESTIMATORS,
    **{f"{name}+": _with_k2_gradient(fn) for name, fn in _BASE_ESTIMATORS.items()},
}
"""Config name -> per-token estimator `(logprobs_BT, ref_logprobs_BT) -> kl_BT` (see the module docstring)."""


def kl_penalty(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, *, kind: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference on the sampled tokens.

    Args:
        logprobs_BT: (B, T) log pi(x_t) of the sampled tokens (carries gradient when used as a loss).
        ref_logprobs_BT: (B, T) log pi_ref(x_t), a constant.
        kind: a key of `KL_ESTIMATORS`: `k1`/`kl`, `abs`, `k2`/`mse`, `k3`/`low_var_kl`, or any of them with `+`.

    Returns:
        (B, T) per-token estimate, NOT masked or aggregated: aggregate with `agg_loss` (KL loss) or
        `apply_kl_in_reward` (KL penalty in the reward).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator kind {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    if logprobs_BT.shape != ref_logprobs_BT.shape:
        raise ValueError(
            f"logprobs_BT {tuple(logprobs_BT.shape)} and ref_logprobs_BT "
            f"{tuple(ref_logprobs_BT.shape)} must have the same shape"
        )
    return KL_ESTIMATORS[kind](logprobs_BT, ref_logprobs_BT.detach())


@torch.no_grad()
def apply_kl_in_reward(
    token_scores_BT: Tensor, logprobs_BT: Tensor, ref_logprobs_BT: Tensor, mask_BT: Tensor, *, coef: float, kind: str
) -> tuple[Tensor, Tensor]:
    """Subtract a per-token KL penalty from the per-token rewards (InstructGPT-style PPO, REINFORCE++).

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593:
    r_t = score_t - coef * KL_t, where `score_t` is usually the outcome score on the last valid token
    (`token_level_scores`) and `logprobs_BT` are the rollout's (old) log-probabilities.

    Args:
        token_scores_BT: (B, T) per-token scores.
        logprobs_BT: (B, T) log-probs of the sampled tokens under the policy that generated them.
        ref_logprobs_BT: (B, T) log-probs under the reference.
        mask_BT: (B, T) response mask; the penalty is 0 at masked positions.
        coef: KL coefficient, e.g. `controller.value`.
        kind: estimator, see `kl_penalty` (the "+" kinds give the same values as their base kind here).

    Returns:
        `(token_rewards_BT, kl_BT)`: the penalised rewards and the masked per-token KL (`sample_mean_kl` of it,
        averaged over the global batch, is what `AdaptiveKLController.update` expects). Computed without autograd.
    """
    kl_BT = kl_penalty(logprobs_BT, ref_logprobs_BT, kind=kind) * (mask_BT > 0)
    return token_scores_BT - coef * kl_BT, kl_BT


@torch.no_grad()
def sample_mean_kl(kl_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Each sample's mean KL over its valid tokens, (B,); 0 for a row without valid tokens.

    The adaptive controller's current KL is the mean of these over the samples of the global batch (sum them and
    count the rows over DP ranks), as verl's `apply_kl_penalty` (ray_trainer.py) computes it: every sample weighs
    the same whatever its length. (verl divides by count + 1e-8; we divide by max(count, 1).)
    """
    if kl_BT.shape != mask_BT.shape or mask_BT.dim() != 2:
        raise ValueError(f"kl_BT {tuple(kl_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must have the same 2-D shape")
    valid_BT = mask_BT > 0
    total_B = torch.where(valid_BT, kl_BT, 0.0).sum(dim=-1)
    return total_B / valid_BT.sum(dim=-1).clamp(min=1).to(total_B.dtype)


class FixedKLController:
    """A constant KL coefficient; `update` does nothing. Same interface as `AdaptiveKLController`."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller that steers the observed KL toward a target.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593, section 2.2:
        e = clip(KL / target_kl - 1, -0.2, 0.2),   beta <- beta * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Update the coefficient after a step.

        Args:
            current_kl: the step's KL over the global batch (same on every rank): the mean over samples of each
                sample's masked mean KL (`sample_mean_kl`), as verl computes it.
            n_steps: how many samples (sequences) the step consumed, as in the paper's batch-size increment.
        """
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


# -- the controllers' config components (``algorithm.kl_ctrl``) ------------------------------------------------------
#
# Picked by name like the policy loss: ``algorithm.kl-ctrl:adaptive --algorithm.kl-ctrl.target-kl 0.02``.

KL_CONTROLS = Registry("KL controller")
"""Every KL controller by its name (``algorithm.kl-ctrl:NAME``)."""


class KLControl(Component):
    """``algorithm.kl_ctrl``: the coefficient of the in-reward KL penalty, with its options."""

    registry = KL_CONTROLS

    def build(self) -> FixedKLController | AdaptiveKLController:
        """The controller (its ``value`` is the coefficient; ``update`` moves it; checkpointed by ``state_dict``)."""
        raise NotImplementedError


def _coef_problems(kl_coef: float) -> list[Problem]:
    return [] if kl_coef >= 0 else [("kl_coef", kl_coef, "must be >= 0")]


@dataclass
class FixedKL(KLControl):
    """The coefficient stays ``kl_coef``."""

    name: ClassVar[str] = "fixed"
    kl_coef: float = 0.001
    """Coefficient of the per-token KL penalty in the reward (>= 0)."""

    def problems(self) -> list[Problem]:
        return _coef_problems(self.kl_coef)

    def build(self):
        return FixedKLController(self.kl_coef)


@dataclass
class AdaptiveKL(KLControl):
    """The coefficient is steered toward ``target_kl`` (Ziegler et al. 2019) by the mean over samples of each sample's
    mean KL, over the global batch."""

    name: ClassVar[str] = "adaptive"
    kl_coef: float = 0.001
    """Initial coefficient of the per-token KL penalty in the reward (>= 0)."""
    target_kl: float = 0.1
    """The per-token KL the controller steers toward (> 0)."""
    horizon: float = 10000.0
    """Samples over which a 20% coefficient change is reached (the controller's time constant; > 0)."""

    def problems(self) -> list[Problem]:
        positive = (("target_kl", self.target_kl), ("horizon", self.horizon))
        return _coef_problems(self.kl_coef) + [(name, v, "must be > 0") for name, v in positive if not v > 0]

    def build(self):
        return AdaptiveKLController(self.kl_coef, self.target_kl, self.horizon)
