"""Loss aggregation: turn a per-token loss matrix into the scalar a micro-batch backpropagates.

Every mode normalises by denominators of the GLOBAL mini-batch (all DP ranks, all micro-batches), which the caller
counts with `local_denominators`, all-reduces once per mini-batch, and passes in. Summing `agg_loss` over every
micro-batch on every rank then gives exactly the loss of the whole mini-batch, whatever the micro-batch size or
DP degree, so changing them never changes the gradient. (FSDP averages gradients over ranks when it
reduce-scatters; the trainer multiplies the loss by the DP size, or reduces with a sum, to undo that.)

Mask convention everywhere: `mask_BT` is 1.0 for response tokens that count and 0.0 for padding and for tool /
observation tokens inside a multi-turn response. A sequence with no valid token contributes 0 to every mode and is
not counted in `global_seqs` (so the padding rows a balancer adds cost nothing).

Modes (L = loss, m = mask, N_tok = global_tokens, N_seq = global_seqs, n_i = valid tokens of sequence i):

| mode                      | value                                   | used by                                  |
|---------------------------|-----------------------------------------|------------------------------------------|
| `token-mean`              | Σ L·m / N_tok                           | DAPO (arXiv 2503.14476), most PPO setups  |
| `token-sum`               | Σ L·m (no normalisation)                | callers that normalise themselves         |
| `seq-mean-token-sum`      | Σ_i Σ_t L·m / N_seq                     | sequence-level objectives                 |
| `seq-mean-token-mean`     | Σ_i (Σ_t L·m / n_i) / N_seq             | GRPO (arXiv 2402.03300), GSPO, GMPO       |
| `seq-mean-token-sum-norm` | Σ L·m / (N_seq · norm_length)           | Dr.GRPO (arXiv 2503.20783)                |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

Count = int | float | Tensor


def local_denominators(mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """Count valid tokens and valid sequences in a (micro-)batch, for the caller to all-reduce.

    Args:
        mask_BT: (B, T) response mask (1.0 valid, 0.0 padding / tool tokens).

    Returns:
        `(tokens, seqs)`: 0-dim int64 tensors on `mask_BT.device`; `seqs` counts only rows with at least one valid
        token. Sum them over all micro-batches of a mini-batch and all DP ranks (one `all_reduce`) to get the
        `global_tokens` / `global_seqs` that `agg_loss` expects. int64 keeps counts exact past 2**24 tokens.
    """
    valid_BT = mask_BT > 0
    tokens = valid_BT.sum(dtype=torch.int64)
    seqs = valid_BT.any(dim=-1).sum(dtype=torch.int64)
    return tokens, seqs


def _safe_denominator(count: Count) -> Count:
    # An all-padding mini-batch has a zero denominator and a zero numerator; the loss is 0, not NaN.
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    return max(count, 1)


def _drop_masked(loss_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    # torch.where rather than loss * mask: inf * 0 is NaN, and padding positions may hold anything.
    valid_BT = mask_BT > 0
    return torch.where(valid_BT, loss_BT, 0.0), valid_BT


def _token_mean(
    loss_BT: Tensor, mask_BT: Tensor, *, global_tokens: Count, global_seqs: Count, norm_length: int | None = None
) -> Tensor:
    loss_BT, _ = _drop_masked(loss_BT, mask_BT)
    return loss_BT.sum() / _safe_denominator(global_tokens)


def _token_sum(
    loss_BT: Tensor, mask_BT: Tensor, *, global_tokens: Count, global_seqs: Count, norm_length: int | None = None
) -> Tensor:
    loss_BT, _ = _drop_masked(loss_BT, mask_BT)
    return loss_BT.sum()


def _seq_mean_token_sum(
    loss_BT: Tensor, mask_BT: Tensor, *, global_tokens: Count, global_seqs: Count, norm_length: int | None = None
) -> Tensor:
    # Rows without valid tokens sum to 0 by themselves, so the sum over all tokens equals Σ_i Σ_t.
    loss_BT, _ = _drop_masked(loss_BT, mask_BT)
    return loss_BT.sum() / _safe_denominator(global_seqs)


def _seq_mean_token_mean(
    loss_BT: Tensor, mask_BT: Tensor, *, global_tokens: Count, global_seqs: Count, norm_length: int | None = None
) -> Tensor:
    loss_BT, valid_BT = _drop_masked(loss_BT, mask_BT)
    seq_len_B = valid_BT.sum(dim=-1).clamp(min=1)
    return (loss_BT.sum(dim=-1) / seq_len_B).sum() / _safe_denominator(global_seqs)


def _seq_mean_token_sum_norm(
    loss_BT: Tensor, mask_BT: Tensor, *, global_tokens: Count, global_seqs: Count, norm_length: int | None = None
) -> Tensor:
    _check_norm_length("seq-mean-token-sum-norm", norm_length)
    loss_BT, _ = _drop_masked(loss_BT, mask_BT)
    return loss_BT.sum() / (_safe_denominator(global_seqs) * norm_length)


AGG_MODES: dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
"""Mode name -> `fn(loss_BT, mask_BT, *, global_tokens, global_seqs, norm_length=None)`; `agg_loss` dispatches."""


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {sorted(AGG_MODES)}")


def _check_norm_length(mode: str, norm_length: int | None) -> None:
    if mode == "seq-mean-token-sum-norm" and (norm_length is None or norm_length <= 0):
        raise ValueError(
            f"loss aggregation mode {mode!r} needs norm_length (the maximum response length, a positive int), "
            f"got {norm_length!r}"
        )


def agg_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    *,
    mode: str,
    global_tokens: Count,
    global_seqs: Count,
    norm_length: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss over a micro-batch, normalised by global-batch denominators.

    Args:
        loss_BT: (B, T) per-token loss. Masked positions are dropped with `torch.where`, not multiplied by 0, so
            a non-finite value there (say from a padding token's log-prob) cannot turn the sum into NaN.
        mask_BT: (B, T) response mask, 1.0 for tokens that count, 0.0 for padding and tool/observation tokens.
        mode: one of `AGG_MODES` (see the module docstring for the formulas).
        global_tokens: valid tokens in the whole mini-batch over all DP ranks (from `local_denominators`,
            all-reduced). Used by `token-mean`.
        global_seqs: sequences with at least one valid token in the whole mini-batch over all DP ranks. Used by the
            `seq-mean-*` modes.
        norm_length: the constant length Dr.GRPO divides by (the maximum response length); required by
            `seq-mean-token-sum-norm`, ignored otherwise.

    Returns:
        0-dim tensor. Summed over all micro-batches and ranks it equals the loss of the whole mini-batch.
        `token-sum` is not normalised at all, so it is trivially additive. A zero denominator (an all-padding
        mini-batch) is treated as 1, giving 0 rather than NaN.
    """
    _check_mode(mode)
    if loss_BT.shape != mask_BT.shape:
        raise ValueError(f"loss_BT {tuple(loss_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must have the same shape")
    return AGG_MODES[mode](
        loss_BT, mask_BT, global_tokens=global_tokens, global_seqs=global_seqs, norm_length=norm_length
    )


@dataclass(frozen=True, eq=False)  # eq=False: fields may be tensors, whose == is elementwise
class AggArgs:
    """How a policy / value loss is reduced to a scalar: the mode and the global denominators (see `agg_loss`).

    Built once per mini-batch by the trainer (after all-reducing `local_denominators`) and passed to every loss of
    that mini-batch. Validates the mode, and that `norm_length` is given for `seq-mean-token-sum-norm`, at
    construction so a bad config fails before the first backward.
    """

    mode: str
    """Aggregation mode, a key of `AGG_MODES`."""
    global_tokens: Count
    """Valid tokens in the whole mini-batch, all DP ranks."""
    global_seqs: Count
    """Sequences with at least one valid token in the whole mini-batch, all DP ranks."""
    norm_length: int | None = None
    """Dr.GRPO's constant divisor (max response length); only for `seq-mean-token-sum-norm`."""

    def __post_init__(self) -> None:
        _check_mode(self.mode)
        _check_norm_length(self.mode, self.norm_length)

    @classmethod
    def from_mask(cls, mask_BT: Tensor, *, mode: str, norm_length: int | None = None) -> AggArgs:
        """Denominators counted from `mask_BT` alone: right only when `mask_BT` is the whole mini-batch
        (single process, no micro-batching), e.g. in tests and scripts."""
        tokens, seqs = local_denominators(mask_BT)
        return cls(mode=mode, global_tokens=tokens, global_seqs=seqs, norm_length=norm_length)

    def __call__(self, loss_BT: Tensor, mask_BT: Tensor) -> Tensor:
        """`agg_loss(loss_BT, mask_BT, ...)` with these settings."""
        return agg_loss(
            loss_BT,
            mask_BT,
            mode=self.mode,
            global_tokens=self.global_tokens,
            global_seqs=self.global_seqs,
            norm_length=self.norm_length,
        )
