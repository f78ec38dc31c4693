"""Loss aggregation and KL control against hand-computed values."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlspmd.algorithms import (
    AGG_MODES,
    KL_ESTIMATORS,
    AdaptiveKLController,
    AggArgs,
    FixedKLController,
    agg_loss,
    apply_kl_in_reward,
    kl_penalty,
    sample_mean_kl,
    local_denominators,
)

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------------------------------------------------------
# Aggregation

LOSS = t([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
MASK = t([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # row 2 has no valid token


def test_local_denominators():
    tokens, seqs = local_denominators(MASK)
    assert (tokens.item(), seqs.item()) == (6, 2)  # the all-masked row is not a sequence
    assert tokens.dtype == torch.int64


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 29 / 6),  # masked sum = 1+2 + 5+6+7+8 = 29 over 6 tokens
        ("token-sum", 29.0),
        ("seq-mean-token-sum", 29 / 2),  # (3 + 26) / 2 sequences
        ("seq-mean-token-mean", 4.0),  # (3/2 + 26/4) / 2 = (1.5 + 6.5) / 2
        ("seq-mean-token-sum-norm", 3.625),  # 29 / (2 sequences * norm_length 4)
    ],
)
def test_agg_modes_hand_values(mode, expected):
    out = agg_loss(LOSS, MASK, mode=mode, global_tokens=6, global_seqs=2, norm_length=4)
    assert_close(out, t(expected))


def test_agg_errors():
    with pytest.raises(ValueError, match="norm_length"):
        agg_loss(LOSS, MASK, mode="seq-mean-token-sum-norm", global_tokens=6, global_seqs=2)
    with pytest.raises(ValueError, match="norm_length"):
        AggArgs(mode="seq-mean-token-sum-norm", global_tokens=6, global_seqs=2)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        AggArgs(mode="token_mean", global_tokens=6, global_seqs=2)


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_agg_ignores_non_finite_values_at_masked_positions(mode):
    dirty = torch.where(MASK > 0, LOSS, math.inf)
    assert_close(
        agg_loss(dirty, MASK, mode=mode, global_tokens=6, global_seqs=2, norm_length=4),
        agg_loss(LOSS, MASK, mode=mode, global_tokens=6, global_seqs=2, norm_length=4),
    )


def test_agg_all_padding_is_zero_not_nan():
    zeros = torch.zeros(2, 3, dtype=F64)
    for mode in AGG_MODES:
        tokens, seqs = local_denominators(zeros)
        out = agg_loss(LOSS[:2, :3], zeros, mode=mode, global_tokens=tokens, global_seqs=seqs, norm_length=3)
        assert out.item() == 0.0


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_micro_batches_with_global_denominators_sum_to_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(9, 7, generator=g, dtype=F64)
    mask = (torch.rand(9, 7, generator=g) > 0.4).to(F64)
    mask[4] = 0  # a padding row inside one micro-batch
    full = AggArgs.from_mask(mask, mode=mode, norm_length=7)(loss, mask)

    # Two "ranks", each with uneven micro-batches; each counts its local denominators, then one "all-reduce".
    micro_batches = [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 9)]
    counts = [local_denominators(mask[mb]) for mb in micro_batches]
    global_tokens = sum(c[0] for c in counts)
    global_seqs = sum(c[1] for c in counts)
    agg = AggArgs(mode=mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_length=7)
    total = sum(agg(loss[mb], mask[mb]) for mb in micro_batches)
    assert_close(total, full, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------------------------
# KL estimators

LOGP = [-1.0, -2.0]
REF = [-1.5, -1.0]
# d = logp - ref = [0.5, -1.0];  log r = ref - logp = [-0.5, 1.0]
# k3 = e^{log r} - log r - 1 = [e^-0.5 + 0.5 - 1, e - 2] = [0.10653066, 0.71828183]
# d k3 / d logp = 1 - e^{log r} = [1 - e^-0.5, 1 - e] = [0.39346934, -1.71828183]
K3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
K3_GRAD = [1 - math.exp(-0.5), 1 - math.e]
EXPECTED = {  # kind: (value, d value / d logp)
    "k1": ([0.5, -1.0], [1.0, 1.0]),
    "kl": ([0.5, -1.0], [1.0, 1.0]),  # verl's name for k1
    "abs": ([0.5, 1.0], [1.0, -1.0]),
    "k2": ([0.125, 0.5], [0.5, -1.0]),
    "mse": ([0.125, 0.5], [0.5, -1.0]),
    "k3": (K3, K3_GRAD),
    "low_var_kl": (K3, K3_GRAD),
    # Straight-through: value of the base estimator, gradient of k2 (= d), for every name verl accepts with "+".
    "k1+": ([0.5, -1.0], [0.5, -1.0]),
    "kl+": ([0.5, -1.0], [0.5, -1.0]),
    "abs+": ([0.5, 1.0], [0.5, -1.0]),
    "k2+": ([0.125, 0.5], [0.5, -1.0]),
    "mse+": ([0.125, 0.5], [0.5, -1.0]),
    "k3+": (K3, [0.5, -1.0]),
    "low_var_kl+": (K3, [0.5, -1.0]),
}


def test_kl_names_are_verls():
    assert set(KL_ESTIMATORS) == set(EXPECTED)


@pytest.mark.parametrize("kind", sorted(KL_ESTIMATORS))
def test_kl_estimators_value_and_gradient(kind):
    logp = t(LOGP).requires_grad_()
    kl = kl_penalty(logp, t(REF), kind=kind)
    kl.sum().backward()
    value, grad = EXPECTED[kind]
    assert_close(kl.detach(), t(value))
    assert_close(logp.grad, t(grad))


def test_k3_is_clamped_and_finite():
    kl = kl_penalty(t([0.0, -200.0]), t([-200.0, 0.0]), kind="k3")
    # log r = -200 -> clamped to -20: e^-20 + 20 - 1 = 19.000000002 -> clamped to 10.
    # log r = +200 -> clamped to 20: e^20 - 21, huge -> clamped to 10.
    assert_close(kl, t([10.0, 10.0]))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(t(LOGP), t(REF), kind="k4")


def test_apply_kl_in_reward():
    scores = t([[0.0, 1.0]])
    # k1 = [0.5, -1.0]; rewards = scores - 0.1 * k1 = [-0.05, 1.1]
    rewards, kl = apply_kl_in_reward(scores, t([LOGP]), t([REF]), t([[1, 1]]), coef=0.1, kind="k1")
    assert_close(rewards, t([[-0.05, 1.1]]))
    assert_close(kl, t([[0.5, -1.0]]))
    # The masked position gets no penalty.
    rewards, kl = apply_kl_in_reward(scores, t([LOGP]), t([REF]), t([[1, 0]]), coef=0.1, kind="k1")
    assert_close(rewards, t([[-0.05, 1.0]]))
    assert_close(kl, t([[0.5, 0.0]]))


def test_sample_mean_kl_weighs_every_sample_alike():
    # Row 0: KL 0.5, -1.0, 3.0 on valid tokens 0 and 2 (position 1 is a tool-token hole): mean (0.5 + 3) / 2 = 1.75.
    # Row 1: a single valid token with KL 0.25. Row 2: no valid token -> 0.
    # The controller's KL (verl's) is the mean of these over samples, (1.75 + 0.25 + 0) / 3 = 2/3, not the
    # per-token mean (0.5 + 3 + 0.25) / 3 = 1.25.
    kl = t([[0.5, -1.0, 3.0], [0.25, 7.0, 7.0], [9.0, 9.0, 9.0]])
    mask = t([[1, 0, 1], [1, 0, 0], [0, 0, 0]])
    per_sample = sample_mean_kl(kl, mask)
    assert_close(per_sample, t([1.75, 0.25, 0.0]))
    assert per_sample.mean().item() == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="same 2-D shape"):
        sample_mean_kl(kl, mask[:2])


# ---------------------------------------------------------------------------------------------------------------
# KL controllers


def test_adaptive_kl_controller_hand_values():
    ctl = AdaptiveKLController(init_coef=0.2, target_kl=6.0, horizon=10000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2; beta *= 1 + 0.2 * 256 / 10000 = 1.00512 -> 0.201024
    ctl.update(9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.201024, abs=1e-15)
    # KL 5.4: error 0.9 - 1 = -0.1; beta *= 1 - 0.1 * 100 / 10000 = 0.999 -> 0.200822976
    ctl.update(torch.tensor(5.4, dtype=F64), n_steps=100)  # a 0-dim tensor is accepted
    assert ctl.value == pytest.approx(0.200822976, abs=1e-15)

    restored = AdaptiveKLController(init_coef=1.0, target_kl=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_coef=0.1, target_kl=0.0, horizon=1)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
