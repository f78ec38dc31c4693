"""Rollout correction in the trainer: resolve ``algorithm.rollout_correction`` for the engine, check bypass mode,
and the stage that adds the correction's weights, mask and metrics to a batch.

The mathematics is `rlspmd.algorithms.rollout_correction`; this module decides whether it is on (``mode=auto``)
from facts the builder knows, and applies it to a ``Batch``:

* `resolve_rollout_correction(cfg, engine=..., rollout_dtype=..., actor_compute_dtype=..., placement=...)` ->
  `ResolvedRolloutCorrection`: concrete mode, level and thresholds, and a sentence saying why.
* `check_bypass(resolved, ppo_epochs=..., mini_batch_size=..., train_batch_size=...)`: bypass mode's conditions.
* `RolloutCorrectionStage(resolved)(batch, metrics)`: once per step when the old log-probs were recomputed (decoupled
  mode; the trainer runs it right after the advantages, so a rejected sample still counts in its group's statistics
  and its score is still placed on its last token, as in verl): adds ``rollout_is_weights_BR``, replaces
  ``loss_mask_BR`` by the mask without rejected tokens (so the update's loss denominators exclude them), and
  records the ``rollout_corr/*`` metrics. `record_correction_metrics` records them for a correction computed elsewhere
  (inside the loss, against the current policy, when there is no old-log-prob pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlspmd.rollout.base import RolloutEngineConfig
from rlspmd.algorithms.rollout_correction import RolloutCorrection, rollout_correction
from rlspmd.config import RolloutCorrectionConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ResolvedRolloutCorrection:
    """``algorithm.rollout_correction`` with ``auto`` and the level's default band resolved."""

    mode: Literal["off", "tis", "mis", "both"]
    """What the correction applies (see `rlspmd.algorithms.rollout_correction`)."""
    level: Literal["token", "sequence"]
    """Per-token or per-sequence (geometric mean) ratio."""
    tis_threshold: float
    """Truncation cap of the weights."""
    mis_lower: float
    """Lower end of the rejection band."""
    mis_upper: float
    """Upper end of the rejection band."""
    ratio_bound: float
    """c of the [1/c, c] mismatch metric."""
    bypass: bool
    """Rollout log-probs serve as the old log-probs."""
    reason: str
    """Why the mode is what it is (for the run's log)."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def summary(self) -> str:
        """One line for the run's log: the mode, its settings, bypass, and why."""
        settings = {
            "off": "",
            "tis": f", tis_threshold={self.tis_threshold:g}",
            "mis": f", band [{self.mis_lower:g}, {self.mis_upper:g}]",
            "both": f", tis_threshold={self.tis_threshold:g}, band [{self.mis_lower:g}, {self.mis_upper:g}]",
        }
        level = "" if self.mode == "off" else f" at {self.level} level"
        bypass = "; bypass: the rollout's log-probs are the old log-probs" if self.bypass else ""
        return f"{self.mode}{level}{settings[self.mode]}{bypass} ({self.reason})"

    def apply(self, train_logprobs_BT, rollout_logprobs_BT, mask_BT) -> RolloutCorrection:
        """`rollout_correction` with these settings."""
        return rollout_correction(
            train_logprobs_BT,
            rollout_logprobs_BT,
            mask_BT,
            mode=self.mode,
            level=self.level,
            tis_threshold=self.tis_threshold,
            mis_lower=self.mis_lower,
            mis_upper=self.mis_upper,
            ratio_bound=self.ratio_bound,
        )


def resolve_rollout_correction(
    cfg: RolloutCorrectionConfig,
    *,
    engine: RolloutEngineConfig,
    rollout_dtype: str,
    actor_compute_dtype: str,
    placement: Literal["colocated", "split"],
    max_staleness: int = 0,
) -> ResolvedRolloutCorrection:
    """Resolve ``mode=auto``: on (``mis``, rejection at ``cfg.level``) when the samples do not come from the trainer's
    own numerics, off when they do.

    The samples come from the trainer's numerics when the engine samples with the trainer's kernels (its ``kernels``
    trait is None: the native engine, torch, sampling from the same logits), its weights are in the actor's compute
    dtype (the colocated engine then reads the actor's gathered weights in place; a split engine receives a
    bit-identical copy after every update) and they are current (``max_staleness`` 0). Anything else (``vllm``, a
    rollout dtype unlike the actor's, weights up to ``max_staleness`` updates old) makes pi_rollout differ from
    pi_train, and auto switches the correction on: rejection (``mis``) for numerics alone, whose ratios stay within the
    narrow default band of an exact sampler; truncated weights (``tis``) when the weights are stale, since one update
    moves a sequence's ratio far past that band and rejection would drop nearly every stale sample (measured: all of
    them, on the tiny model at lr 1e-3). An explicit mode is kept as it is.

    Args:
        cfg: the ``algorithm.rollout_correction`` section.
        engine: ``rollout.engine``, the engine component (its ``kernels`` trait says how its numerics differ).
        rollout_dtype: the rollout engine's weight dtype, resolved (``rollout.dtype``; ``auto`` means the actor's
            compute dtype and is accepted as such).
        actor_compute_dtype: the actor's FSDP compute dtype, resolved (``float32``, ``bfloat16`` or ``float16``).
        placement: ``colocated`` or ``split``. It does not change the rule (a split native engine in the actor's
            dtype samples from a bit-exact copy of the weights); it is part of the reason logged.
        max_staleness: how many updates old the weights behind a batch may be (asynchronous RL); > 0 turns auto on.
    """
    if actor_compute_dtype not in _DTYPES:
        raise ValueError(f"actor compute dtype must be resolved to one of {_DTYPES}, got {actor_compute_dtype!r}")
    if rollout_dtype == "auto":
        rollout_dtype = actor_compute_dtype
    if rollout_dtype not in _DTYPES:
        raise ValueError(f"rollout.dtype={rollout_dtype!r} is not one of {('auto',) + _DTYPES}")
    if placement not in ("colocated", "split"):
        raise ValueError(f"placement {placement!r} is not one of ('colocated', 'split')")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")

    differs = []
    if engine.kernels is not None:
        differs.append(engine.kernels)
    if rollout_dtype != actor_compute_dtype:
        differs.append(f"rollout dtype {rollout_dtype} vs the actor's {actor_compute_dtype}")
    if max_staleness > 0:
        differs.append(f"weights up to {max_staleness} update(s) stale")
    if cfg.mode != "auto":
        mode, reason = cfg.mode, f"mode={cfg.mode} set in the config"
    elif max_staleness > 0:
        # An update moves the policy far past a band meant for kernel noise (+-0.1% per sequence would reject nearly
        # every stale sample): truncated weights instead, AReaL's decoupled PPO.
        mode, reason = "tis", f"auto -> tis at {cfg.level} level: " + ", ".join(differs) + f" ({placement})"
    elif differs:
        mode, reason = "mis", f"auto -> mis at {cfg.level} level: " + ", ".join(differs) + f" ({placement})"
    else:
        mode, reason = (
            "off",
            (
                f"auto -> off: the {engine.name} engine samples with the trainer's weights in "
                f"{actor_compute_dtype} ({placement})"
            ),
        )
    lower, upper = cfg.band()
    return ResolvedRolloutCorrection(
        mode=mode,
        level=cfg.level,
        tis_threshold=cfg.tis_threshold,
        mis_lower=lower,
        mis_upper=upper,
        ratio_bound=cfg.metric_ratio_bound,
        bypass=cfg.bypass,
        reason=reason,
    )


def check_bypass(
    resolved: ResolvedRolloutCorrection, *, ppo_epochs: int, mini_batch_size: int, train_batch_size: int
) -> None:
    """Bypass mode (rollout log-probs as the old log-probs) needs one optimiser update per step and the correction
    on; raises a ``ValueError`` naming the fields otherwise. Does nothing when bypass is off."""
    if not resolved.bypass:
        return
    if ppo_epochs != 1 or mini_batch_size != train_batch_size:
        raise ValueError(
            f"algorithm.rollout_correction.bypass=True needs one optimiser update per step: actor.ppo_epochs=1 and "
            f"actor.mini_batch_size = data.train_batch_size, got actor.ppo_epochs={ppo_epochs}, "
            f"actor.mini_batch_size={mini_batch_size}, data.train_batch_size={train_batch_size} (later updates "
            f"would measure their ratio against a policy that no longer exists)"
        )
    if not resolved.enabled:
        raise ValueError(
            f"algorithm.rollout_correction.bypass=True needs the correction on, but its mode resolved to 'off' "
            f"({resolved.reason}); set algorithm.rollout_correction.mode to tis, mis or both, or turn bypass off "
            f"(actor.reuse_update_logprobs already skips the old-log-prob pass when nothing else needs it)"
        )


def record_correction_metrics(
    correction: RolloutCorrection, metrics: MetricBuffer, *, prefix: str = "rollout_corr/"
) -> None:
    """Add a correction's metrics to ``metrics`` (global means, maxima and minima once reduced over ranks)."""
    for name, (total, count) in correction.means.items():
        metrics.mean(prefix + name, total, count)
    for name, value in correction.maxima.items():
        metrics.max(prefix + name, value)
    for name, value in correction.minima.items():
        metrics.min(prefix + name, value)


class RolloutCorrectionStage:
    """Adds ``rollout_is_weights_BR`` and applies the rejection to ``loss_mask_BR``; its metrics go to the step's.

    Decoupled mode: call once per step after ``actor.old_log_prob`` (it reads ``old_logprobs_BR`` and
    ``rollout_logprobs_BR``); the trainer calls it after the advantages, which read the scores of every sample (verl
    computes its token rewards before the correction changes the mask, to the same effect). With ``mode=off`` the
    weights are 1 and the mask is unchanged, and the metrics are still recorded.
    """

    def __init__(self, resolved: ResolvedRolloutCorrection):
        self.resolved = resolved

    def __call__(self, batch: Batch, metrics: MetricBuffer) -> Batch:
        correction = self.resolved.apply(batch["old_logprobs_BR"], batch["rollout_logprobs_BR"], batch["loss_mask_BR"])
        record_correction_metrics(correction, metrics)
        return batch.set(rollout_is_weights_BR=correction.weights_BT, loss_mask_BR=correction.mask_BT)
