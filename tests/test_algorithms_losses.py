"""Policy and value losses: values and gradients w.r.t. logprobs against hand-computed numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from loss_options import bound, components
from rlspmd.config import SAPO, ClipCov, PPOClip

from rlspmd.algorithms import (
    AGG_MODES,
    POLICY_LOSSES,
    AggArgs,
    cispo,
    clip_cov,
    entropy_bonus,
    gmpo,
    gpg_loss,
    gspo,
    kl_cov,
    local_denominators,
    ppo_clip,
    sapo,
    value_loss,
)

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def logprobs_for(log_ratios, old):
    """Leaf logprobs with logp - old = log_ratios exactly (old is given)."""
    return (t(old) + t(log_ratios)).requires_grad_()


def run(loss_fn, log_ratios, advantages, mask, *, mode="token-mean", old=None, **kw):
    old = old if old is not None else [[-1.0] * len(log_ratios[0])] * len(log_ratios)
    logp = logprobs_for(log_ratios, old)
    mask = t(mask)
    agg = AggArgs.from_mask(mask, mode=mode)
    loss, metrics = loss_fn(logp, t(old), t(advantages), mask, agg=agg, **kw)
    loss.backward()
    return loss.detach(), logp.grad, metrics


# ---------------------------------------------------------------------------------------------------------------
# PPO clip: one token per regime. clip_low 0.2 -> lower bound 0.8; clip_high 0.28 -> upper 1.28; clip_ratio_c 3.
#   t0 A=+1 r=1.1  unclipped          loss -1.1   grad -A r = -1.1
#   t1 A=+1 r=1.5  clipped high       loss -1.28  grad 0
#   t2 A=-1 r=0.5  clipped low        loss  0.8   grad 0
#   t3 A=-1 r=4    dual clipped       loss  3     grad 0      (max(4, 1.28) = 4, capped at -A c = 3)
#   t4 A=-1 r=2    unclipped (A<0)    loss  2     grad -A r = 2
#   t5 masked
# token-mean over 5 valid tokens: loss = (-1.1 - 1.28 + 0.8 + 3 + 2) / 5 = 3.42 / 5 = 0.684

PPO_RATIOS = [[1.1, 1.5, 0.5, 4.0, 2.0, 1.0]]
PPO_LOG_RATIOS = [[math.log(r) for r in PPO_RATIOS[0]]]
PPO_ADV = [[1.0, 1.0, -1.0, -1.0, -1.0, 5.0]]
PPO_MASK = [[1, 1, 1, 1, 1, 0]]


def test_ppo_clip_each_regime():
    loss, grad, metrics = run(
        ppo_clip, PPO_LOG_RATIOS, PPO_ADV, PPO_MASK, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0
    )
    assert_close(loss, t(0.684))
    assert_close(grad, t([[-1.1 / 5, 0, 0, 0, 2.0 / 5, 0]]))
    assert metrics["clip_frac"].item() == pytest.approx(2 / 5)  # t1, t2
    assert metrics["clip_frac_upper"].item() == pytest.approx(1 / 5)  # t1: A > 0, ratio above 1 + clip_high
    assert metrics["clip_frac_lower"].item() == pytest.approx(1 / 5)  # t2: A < 0, ratio below 1 - clip_low
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 5)  # t3
    assert metrics["ratio_mean"].item() == pytest.approx(9.1 / 5)  # (1.1 + 1.5 + 0.5 + 4 + 2) / 5
    # approx_kl = mean(old - new) = -(ln 1.1 + ln 1.5 + ln 0.5 + ln 4 + ln 2) / 5 = -ln(6.6) / 5
    assert metrics["approx_kl"].item() == pytest.approx(-math.log(6.6) / 5)
    assert all(not m.requires_grad for m in metrics.values())


def test_ppo_clip_with_per_token_weights():
    # Rollout-correction weights multiply each token's loss (verl's rollout_is_weights); the masked t5's weight is
    # garbage and ignored. loss = (2 * -1.1 + 3 * -1.28 + 0.5 * 0.8 + 1 * 3 + 0.25 * 2) / 5 = -2.14 / 5;
    # the gradient of the unclipped tokens scales with their weight: t0 2 * -1.1 / 5, t4 0.25 * 2 / 5.
    weights = t([[2.0, 3.0, 0.5, 1.0, 0.25, math.nan]])
    loss, grad, _ = run(
        ppo_clip, PPO_LOG_RATIOS, PPO_ADV, PPO_MASK, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, weights_BT=weights
    )
    assert_close(loss, t(-2.14 / 5))
    assert_close(grad, t([[2 * -1.1 / 5, 0, 0, 0, 0.25 * 2 / 5, 0]]))
    with pytest.raises(ValueError, match="weights_BT"):
        run(ppo_clip, PPO_LOG_RATIOS, PPO_ADV, PPO_MASK, weights_BT=weights[:, :3])


def test_ppo_clip_without_dual_clip():
    # t3 is no longer capped: loss 4, grad -A r = 4. loss = (-1.1 - 1.28 + 0.8 + 4 + 2) / 5 = 4.42 / 5
    loss, grad, metrics = run(
        ppo_clip, PPO_LOG_RATIOS, PPO_ADV, PPO_MASK, clip_low=0.2, clip_high=0.28, clip_ratio_c=None
    )
    assert_close(loss, t(4.42 / 5))
    assert_close(grad, t([[-1.1 / 5, 0, 0, 4.0 / 5, 2.0 / 5, 0]]))
    assert metrics["dual_clip_frac"].item() == 0.0
    assert PPOClip(clip_ratio_c=1.0).problems() == [
        ("clip_ratio_c", 1.0, "the dual-clip bound must be > 1, or None (off)")
    ]


# ---------------------------------------------------------------------------------------------------------------
# GSPO, seq-mean-token-mean over 3 sequences, clip range [0.8, 1.2].
#   row 0: 2 valid tokens, log ratios (0.2, 0.0): s = e^0.1 = 1.1051709, A = 2, unclipped.
#          loss_t = -2 s; grad per token = -A s / (n G) = -2 * 1.1051709 / (2 * 3) = -0.3683903
#   row 1: valid tokens at 0, 2, 3 (1 is a hole with a huge log ratio that must be ignored), log ratio 0.3 each:
#          s = e^0.3 = 1.3498588 > 1.2 with A = 1 -> clipped: loss_t = -1.2, grad 0.
#   row 2: 4 tokens, log ratios (0, 0, 0, -0.4): s = e^-0.1 = 0.9048374, A = -1, unclipped (>= 0.8):
#          loss_t = 0.9048374; grad per token = -A s / (n G) = 0.9048374 / 12 = 0.0754031
#   loss = (-2 * 1.1051709 - 1.2 + 0.9048374) / 3


def test_gspo_values_and_gradient():
    log_ratios = [[0.2, 0.0, 0.0, 0.0], [0.3, 9.0, 0.3, 0.3], [0.0, 0.0, 0.0, -0.4]]
    adv = [[2.0] * 4, [1.0] * 4, [-1.0] * 4]
    mask = [[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]]
    loss, grad, metrics = run(gspo, log_ratios, adv, mask, mode="seq-mean-token-mean", clip_low=0.2, clip_high=0.2)
    s0, s2 = math.exp(0.1), math.exp(-0.1)
    assert_close(loss, t((-2 * s0 - 1.2 + s2) / 3))
    g0, g2 = -2 * s0 / 6, s2 / 12
    assert_close(grad, t([[g0, g0, 0, 0], [0, 0, 0, 0], [g2, g2, g2, g2]]))
    assert metrics["clip_frac"].item() == pytest.approx(3 / 9)  # the 3 valid tokens of row 1
    # Per-token seq ratios averaged over the 9 valid tokens: (2 s0 + 3 e^0.3 + 4 s2) / 9.
    assert metrics["seq_ratio_mean"].item() == pytest.approx((2 * s0 + 3 * math.exp(0.3) + 4 * s2) / 9)


def test_gspo_aggregates_per_sequence_whatever_the_mode_and_clamps_like_verl():
    log_ratios = [[0.2, 0.0, 0.0, 0.0], [0.3, 9.0, 0.3, 0.3], [0.0, 0.0, 0.0, -0.4]]
    adv = [[2.0] * 4, [1.0] * 4, [-1.0] * 4]
    mask = [[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]]
    want, want_grad, _ = run(gspo, log_ratios, adv, mask, mode="seq-mean-token-mean")
    for mode in ("token-mean", "seq-mean-token-sum"):
        loss, grad, _ = run(gspo, log_ratios, adv, mask, mode=mode)
        assert torch.equal(loss, want) and torch.equal(grad, want_grad), mode
    # A sequence whose mean log-ratio is 12 (A < 0, so unclipped) has its log-ratio clamped at 10 as in verl:
    # loss -A e^10 and no gradient (the clamp cuts it).
    loss, grad, _ = run(gspo, [[12.0, 12.0]], [[-1.0, -1.0]], [[1, 1]], mode="seq-mean-token-mean")
    assert_close(loss, t(math.exp(10.0)))
    assert torch.equal(grad, torch.zeros(1, 2, dtype=F64))


# ---------------------------------------------------------------------------------------------------------------
# CISPO, token-mean over 3 tokens, weight clip [0.8, 1.28]; the gradient is -sg(clip(r)) A, never zeroed.
#   t0 A=+1 r=1.1 -> w 1.1  grad -1.1/3
#   t1 A=+1 r=1.5 -> w 1.28 grad -1.28/3 (PPO would give 0 here)
#   t2 A=-1 r=0.5 -> w 0.8  grad +0.8/3


def test_cispo_values_and_gradient():
    log_ratios = [[math.log(1.1), math.log(1.5), math.log(0.5)]]
    loss, grad, metrics = run(cispo, log_ratios, [[1.0, 1.0, -1.0]], [[1, 1, 1]], clip_low=0.2, clip_high=0.28)
    assert_close(grad, t([[-1.1 / 3, -1.28 / 3, 0.8 / 3]]))
    # loss = -sum(w A logp) / 3 with logp = log r - 1 (old = -1)
    logp = [math.log(1.1) - 1, math.log(1.5) - 1, math.log(0.5) - 1]
    assert_close(loss, t(-(1.1 * logp[0] + 1.28 * logp[1] - 0.8 * logp[2]) / 3))
    assert metrics["clip_frac"].item() == pytest.approx(2 / 3)
    assert metrics["clip_frac_upper"].item() == pytest.approx(1 / 3)  # t1 (A > 0)
    assert metrics["clip_frac_lower"].item() == pytest.approx(1 / 3)  # t2 (A < 0)


# ---------------------------------------------------------------------------------------------------------------
# GPG loss: -A logp, token-mean over 2 tokens: grads -A / 2 = [-1, 0.5].


def test_gpg_loss_values_and_gradient():
    loss, grad, metrics = run(gpg_loss, [[0.3, -0.2]], [[2.0, -1.0]], [[1, 1]], old=[[-1.0, -2.0]])
    # logp = [-0.7, -2.2]; loss = -(2 * -0.7 + (-1) * -2.2) / 2 = -(-1.4 + 2.2) / 2 = -0.4
    assert_close(loss, t(-0.4))
    assert_close(grad, t([[-1.0, 0.5]]))
    assert metrics["clip_frac"].item() == 0.0


# ---------------------------------------------------------------------------------------------------------------
# SAPO: loss_t = -sigmoid(tau (r - 1)) * 4 / tau * A, tau = 1 for A > 0, 1.05 for A < 0; token-mean over 3.
#   t0 A=+1 r=1: gate 0.5 -> loss -2;          grad -A r 4 * 0.5 * 0.5 = -1
#   t1 A=-1 r=1: gate 0.5 -> loss 2/1.05;       grad +1
#   t2 A=+1 r=e^0.5: x = e^0.5 - 1, loss -4 sigmoid(x); grad -r 4 sigmoid(x) (1 - sigmoid(x))


def test_sapo_values_and_gradient():
    loss, grad, metrics = run(sapo, [[0.0, 0.0, 0.5]], [[1.0, -1.0, 1.0]], [[1, 1, 1]], tau_pos=1.0, tau_neg=1.05)
    r = math.exp(0.5)
    sig = 1 / (1 + math.exp(-(r - 1)))
    assert_close(loss, t((-2 + 2 / 1.05 - 4 * sig) / 3))
    assert_close(grad, t([[-1 / 3, 1 / 3, -r * 4 * sig * (1 - sig) / 3]]))
    assert metrics["soft_gate_weight"].item() == pytest.approx((1 + 1 + 4 * sig * (1 - sig)) / 3)
    assert SAPO(tau_pos=0.0).problems() == [("tau_pos", 0.0, "must be > 0")]


def test_sapo_aggregates_per_sequence_whatever_the_mode():
    # Row 0: 1 valid token with A = 3; row 1: 3 tokens with A = 1; r = 1 (gate 0.5), so loss_t = -2 A_t.
    # seq-mean-token-mean: (-6 + (-2 - 2 - 2) / 3) / 2 = -4 in every mode (token-mean would give -12 / 4 = -3).
    for mode in ("token-mean", "seq-mean-token-mean", "token-sum"):
        loss, _, _ = run(
            sapo, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[3.0] * 3, [1.0] * 3], [[1, 0, 0], [1, 1, 1]], mode=mode
        )
        assert_close(loss, t(-4.0), msg=mode)


# ---------------------------------------------------------------------------------------------------------------
# GMPO, seq-mean-token-mean over 2 sequences, log-space clip (-0.4, 0.4).
#   row 0: A=+1, log ratios (0.1, 0.5, -0.6): keep min(l, clip(l)) = (0.1, 0.4 [clipped], -0.6)
#          mean (0.1 + 0.4 - 0.6) / 3 = -1/30; gm = e^(-1/30); loss_0 = -gm
#          grad at t0, t2 = -A gm / (n G) = -gm / 6; t1 (clipped) 0
#   row 1: A=-1, log ratios (-0.5, 0.2, masked): keep max(l, clip(l)) = (-0.4 [clipped], 0.2)
#          mean -0.1; gm = e^-0.1; loss_1 = +gm; grad at t1 = gm / (2 * 2); t0 0
#   loss = (-e^(-1/30) + e^-0.1) / 2


def test_gmpo_values_and_gradient():
    log_ratios = [[0.1, 0.5, -0.6], [-0.5, 0.2, 3.0]]
    loss, grad, metrics = run(
        gmpo,
        log_ratios,
        [[1.0] * 3, [-1.0] * 3],
        [[1, 1, 1], [1, 1, 0]],
        mode="seq-mean-token-mean",
        clip_low=0.4,
        clip_high=0.4,
    )
    gm0, gm1 = math.exp(-1 / 30), math.exp(-0.1)
    assert_close(loss, t((-gm0 + gm1) / 2))
    assert_close(grad, t([[-gm0 / 6, 0, -gm0 / 6], [0, gm1 / 4, 0]]))
    assert metrics["clip_frac"].item() == pytest.approx(2 / 5)  # gradient removed: row 0 t1, row 1 t0
    # verl's split by advantage sign counts every log-ratio outside (-0.4, 0.4): row 0 t1 and t2 (A > 0; t2's
    # -0.6 was kept by the min but is outside), row 1 t0 (A < 0).
    assert metrics["clip_frac_upper"].item() == pytest.approx(2 / 5)
    assert metrics["clip_frac_lower"].item() == pytest.approx(1 / 5)
    # Whatever the mode, GMPO is the mean over sequences (verl's torch.mean over them).
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum"):
        other, other_grad, _ = run(
            gmpo, log_ratios, [[1.0] * 3, [-1.0] * 3], [[1, 1, 1], [1, 1, 0]], mode=mode, clip_low=0.4, clip_high=0.4
        )
        assert torch.equal(other, loss) and torch.equal(other_grad, grad), mode


def test_gmpo_weights_act_through_their_geometric_mean():
    # Row 0's weights (2, 0.5, 1) have geometric mean 1: unchanged. Row 1's valid weights (4, 1) have geometric
    # mean 2 (its masked third weight is ignored): loss_1 and its gradient double.
    log_ratios = [[0.1, 0.5, -0.6], [-0.5, 0.2, 3.0]]
    weights = t([[2.0, 0.5, 1.0], [4.0, 1.0, 1e6]])
    loss, grad, _ = run(
        gmpo,
        log_ratios,
        [[1.0] * 3, [-1.0] * 3],
        [[1, 1, 1], [1, 1, 0]],
        mode="seq-mean-token-mean",
        clip_low=0.4,
        clip_high=0.4,
        weights_BT=weights,
    )
    gm0, gm1 = math.exp(-1 / 30), math.exp(-0.1)
    assert_close(loss, t((-gm0 + 2 * gm1) / 2))
    assert_close(grad, t([[-gm0 / 6, 0, -gm0 / 6], [0, 2 * gm1 / 4, 0]]))


# ---------------------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov on one batch: row 0 A = +2, row 1 A = -2 (mean A = 0), 3 tokens each, all valid.
#   logp: row 0 (-0.5, -3.0, -1.0), row 1 (-0.5, -3.0, -2.0); mean logp = -10/6.
#   cov_t = A_t (logp_t + 10/6): row 0 (2.333, -2.667, 1.333), row 1 (-2.333, 2.667, 0.667).
COV_LOGP = [[-0.5, -3.0, -1.0], [-0.5, -3.0, -2.0]]
COV_ADV = [[2.0] * 3, [-2.0] * 3]


def cov_run(fn, log_ratios, **kw):
    old = [[lp - lr for lp, lr in zip(row_lp, row_lr)] for row_lp, row_lr in zip(COV_LOGP, log_ratios)]
    return run(fn, log_ratios, COV_ADV, [[1, 1, 1], [1, 1, 1]], old=old, **kw)


def test_clip_cov_removes_the_gradient_of_drawn_high_covariance_tokens():
    # Log-ratios row 0 (0, 0, 0.5), row 1 zeros; clip range [0.8, 1.2]. Row 0 t2 (ratio e^0.5, A > 0) is clipped by
    # PPO, so it cannot be drawn though its cov 1.333 is in (1, 5); eligible: row 0 t0 (2.333), row 1 t1 (2.667).
    # clip_cov_ratio 0.5 -> budget int(0.5 * 6) = 3 >= 2 eligible: both drawn, their loss set to 0.
    # Losses: row 0 (0, -2, -2 * 1.2), row 1 (2, 0, 2); token-mean: (-2 - 2.4 + 2 + 2) / 6 = -0.4 / 6.
    # Gradients -A r / 6 on the kept unclipped tokens: row 0 t1 -2/6, row 1 t0 and t2 2/6.
    lr = [[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]
    loss, grad, metrics = cov_run(clip_cov, lr, clip_low=0.2, clip_high=0.2, clip_cov_ratio=0.5)
    assert_close(loss, t(-0.4 / 6))
    assert_close(grad, t([[0, -2 / 6, 0], [2 / 6, 0, 2 / 6]]))
    assert metrics["cov_clip_frac"].item() == pytest.approx(2 / 6)
    assert metrics["clip_frac"].item() == pytest.approx(1 / 6)
    assert metrics["clip_frac_upper"].item() == pytest.approx(1 / 6)

    # A budget of 1 (the default ratio 2e-4 on 6 tokens, at least one token) draws one of the two, at random:
    # reproducible with a seeded generator, and each candidate comes up for some seed.
    drawn = set()
    for seed in range(8):
        _, grad, metrics = cov_run(clip_cov, lr, generator=torch.Generator().manual_seed(seed))
        _, grad_again, _ = cov_run(clip_cov, lr, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(grad, grad_again) and metrics["cov_clip_frac"].item() == pytest.approx(1 / 6)
        zero = {(0, 0), (1, 1)} & {(i, j) for i in range(2) for j in range(3) if grad[i, j] == 0}
        assert len(zero) == 1
        drawn |= zero
    assert drawn == {(0, 0), (1, 1)}
    assert [name for name, _, _ in ClipCov(clip_cov_lb=5.0, clip_cov_ub=1.0).problems()] == ["clip_cov_lb"]
    assert [name for name, _, _ in ClipCov(clip_cov_ratio=0.0).problems()] == ["clip_cov_ratio"]


def test_kl_cov_penalises_the_top_covariance_tokens():
    # Log-ratios row 0 (0.1, 0, 0.5), row 1 (0, -0.2, 0). kl_cov_ratio 0.34 -> k = int(6 * 0.34) = 2: the two largest
    # covariances, row 1 t1 (2.667) and row 0 t0 (2.333), get + 1.0 * |log-ratio|; no token is clipped.
    #   row 0: -2 e^0.1 + 0.1, -2, -2 e^0.5        row 1: 2, 2 e^-0.2 + 0.2, 2
    # Gradients / 6: -A r plus sign(log-ratio) on the penalised tokens.
    lr = [[0.1, 0.0, 0.5], [0.0, -0.2, 0.0]]
    loss, grad, metrics = cov_run(kl_cov, lr, kl_cov_ratio=0.34, kl_cov_coef=1.0)
    e = math.exp
    assert_close(loss, t((-2 * e(0.1) + 0.1 - 2 - 2 * e(0.5) + 2 + 2 * e(-0.2) + 0.2 + 2) / 6))
    assert_close(grad, t([[(-2 * e(0.1) + 1) / 6, -2 / 6, -2 * e(0.5) / 6], [2 / 6, (2 * e(-0.2) - 1) / 6, 2 / 6]]))
    assert metrics["kl_cov_frac"].item() == pytest.approx(2 / 6)
    assert metrics["abs_kl"].item() == pytest.approx(0.8 / 6)
    assert metrics["clip_frac"].item() == 0.0
    # The default (verl's) coefficient 0.1 and at least one token: only row 1 t1 is penalised.
    loss, _, _ = cov_run(kl_cov, lr)
    assert_close(loss, t((-2 * e(0.1) - 2 - 2 * e(0.5) + 2 + 2 * e(-0.2) + 0.1 * 0.2 + 2) / 6))


# ---------------------------------------------------------------------------------------------------------------
# Shared behaviour of all policy losses


def random_batch(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).contiguous()
    mask = (torch.rand(B, T, generator=g) > 0.3).to(F64)
    return logp, old, adv, mask


COMPONENTS = components(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=5.0, kl_cov_ratio=0.2, kl_cov_coef=1.0)


def test_every_shipped_policy_loss_is_tested_here():
    assert POLICY_LOSSES.shipped() == set(COMPONENTS)
    assert all(type(COMPONENTS[name]) is POLICY_LOSSES[name] for name in COMPONENTS)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.shipped()))
def test_policy_losses_share_signature_and_ignore_padding(name):
    fn = getattr(bound(COMPONENTS[name]), "func", bound(COMPONENTS[name]))  # the function, its options unbound
    bind = lambda: bound(COMPONENTS[name])  # noqa: E731  (a fresh generator per call)
    logp, old, adv, mask = random_batch()
    for mode in ("token-mean", "seq-mean-token-mean"):
        agg = AggArgs.from_mask(mask, mode=mode)
        full_logp = logp.clone().requires_grad_()
        full, metrics = bind()(full_logp, old, adv, mask, agg=agg)
        full.backward()
        assert {"clip_frac", "clip_frac_upper", "clip_frac_lower", "approx_kl", "ratio_mean"} <= set(metrics)
        assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())
        assert torch.all(full_logp.grad[mask == 0] == 0)

        # Garbage at masked positions (a -inf padding log-prob, NaN old log-prob / advantage / weight) changes
        # nothing.
        dirty_logp = torch.where(mask > 0, logp, -math.inf).requires_grad_()
        dirty_old = torch.where(mask > 0, old, math.nan)
        dirty_adv = torch.where(mask > 0, adv, math.nan)
        dirty_w = torch.where(mask > 0, 1.0, math.nan).to(F64)
        dirty, _ = bind()(dirty_logp, dirty_old, dirty_adv, mask, agg=agg, weights_BT=dirty_w)
        dirty.backward()
        assert_close(dirty, full, rtol=1e-12, atol=1e-12)
        assert_close(dirty_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-12)

    # a loss takes its own options only: another loss's option, or a typo, is a TypeError
    other = "tau_pos" if name != "sapo" else "clip_low"
    for option in (other, "tau_typo"):
        with pytest.raises(TypeError, match=option):
            fn(logp, old, adv, mask, agg=AggArgs.from_mask(mask, mode="token-mean"), **{option: 1.0})


@pytest.mark.parametrize("name", sorted(n for n in POLICY_LOSSES.shipped() if not POLICY_LOSSES[n].micro_batch_local))
def test_policy_losses_are_additive_over_micro_batches(name):
    fn = bound(COMPONENTS[name])
    logp, old, adv, mask = random_batch()
    for mode in ("token-mean", "seq-mean-token-mean"):
        full_logp = logp.clone().requires_grad_()
        full, _ = fn(full_logp, old, adv, mask, agg=AggArgs.from_mask(mask, mode=mode))
        full.backward()
        # Micro-batches with global denominators: same loss and same gradient.
        tokens, seqs = local_denominators(mask)
        agg = AggArgs(mode=mode, global_tokens=tokens, global_seqs=seqs)
        split_logp = logp.clone().requires_grad_()
        total = sum(
            fn(split_logp[mb], old[mb], adv[mb], mask[mb], agg=agg)[0] for mb in (slice(0, 2), slice(2, 3), slice(3, 6))
        )
        total.backward()
        assert_close(total, full, rtol=1e-12, atol=1e-12)
        assert_close(split_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-12)


def test_micro_batch_local_losses_are_the_covariance_ones():
    # Their token selection uses micro-batch statistics (as verl's); tests/test_distributed.py skips them in the
    # 1-rank vs 2-rank gradient comparison for that reason.
    assert {n for n in POLICY_LOSSES.shipped() if POLICY_LOSSES[n].micro_batch_local} == {"clip_cov", "kl_cov"}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.shipped()))
@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_all_ones_weights_reproduce_the_loss_bit_for_bit(name, mode):
    logp, old, adv, mask = random_batch(seed=1)
    agg = AggArgs.from_mask(mask, mode=mode, norm_length=5)
    results = []
    for weights in (None, torch.ones_like(logp), torch.ones(logp.shape, dtype=torch.float32)):
        x = logp.clone().requires_grad_()
        loss, metrics = bound(COMPONENTS[name])(x, old, adv, mask, agg=agg, weights_BT=weights)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    for loss, grad, metrics in results[1:]:
        assert torch.equal(loss, results[0][0]) and loss.dtype == results[0][0].dtype
        assert torch.equal(grad, results[0][1])
        assert all(torch.equal(metrics[k], v) for k, v in results[0][2].items())


def test_policy_loss_on_policy_gradient_is_vanilla_pg():
    # At logp == old every ratio-based loss (unclipped there) has gradient -A / N per token, like REINFORCE.
    logp_values = [[-1.0, -2.0, -0.5]]
    for name in ("ppo_clip", "cispo", "sapo", "gpg"):
        _, grad, _ = run(bound(COMPONENTS[name]), [[0.0, 0.0, 0.0]], [[1.0, -2.0, 0.5]], [[1, 1, 1]], old=logp_values)
        assert_close(grad, t([[-1.0 / 3, 2.0 / 3, -0.5 / 3]]), msg=name)


# ---------------------------------------------------------------------------------------------------------------
# Value loss and entropy
#   t0 v=1.0 old=0.8 R=1.5: |v-old| 0.2 < 0.5, both terms (v-R)^2 = 0.25 -> loss 0.125, grad v-R = -0.5
#   t1 v=2.0 old=1.0 R=0.0: clipped v 1.5; (v-R)^2 = 4 > 2.25 -> unclipped wins: loss 2, grad v-R = 2
#   t2 v=1.5 old=0.0 R=2.0: clipped v 0.5; (0.5-2)^2 = 2.25 > 0.25 -> clipped wins: loss 1.125, grad 0
#   token-mean: loss (0.125 + 2 + 1.125) / 3 = 3.25 / 3; grads [-0.5/3, 2/3, 0]


def test_value_loss_clipping():
    values = t([[1.0, 2.0, 1.5]]).requires_grad_()
    mask = t([[1, 1, 1]])
    loss, metrics = value_loss(
        values,
        t([[0.8, 1.0, 0.0]]),
        t([[1.5, 0.0, 2.0]]),
        mask,
        clip_range=0.5,
        agg=AggArgs.from_mask(mask, mode="token-mean"),
    )
    loss.backward()
    assert_close(loss.detach(), t(3.25 / 3))
    assert_close(values.grad, t([[-0.5 / 3, 2 / 3, 0.0]]))
    assert metrics["vf_clip_frac"].item() == pytest.approx(1 / 3)

    # Unclipped: 0.5 * (0.25 + 4 + 0.25) / 3
    loss, metrics = value_loss(
        values.detach(),
        t([[0.8, 1.0, 0.0]]),
        t([[1.5, 0.0, 2.0]]),
        mask,
        clip_range=None,
        agg=AggArgs.from_mask(mask, mode="token-mean"),
    )
    assert_close(loss, t(0.75))


def test_entropy_bonus_uses_agg():
    mask = t([[1, 1, 0], [1, 0, 0]])
    # seq-mean-token-mean: ((0.5 + 1.5) / 2 + 3) / 2 = 2
    out = entropy_bonus(
        t([[0.5, 1.5, 9.0], [3.0, 9.0, 9.0]]), mask, agg=AggArgs.from_mask(mask, mode="seq-mean-token-mean")
    )
    assert_close(out, t(2.0))
