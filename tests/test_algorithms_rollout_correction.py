"""Rollout correction (importance weights pi_train / pi_rollout, truncation, rejection, mismatch metrics) against
hand-computed values; its use inside every policy loss; ``mode=auto`` resolution, bypass checks and the stage."""

import math

import pytest
import torch
from torch.testing import assert_close

from loss_options import bound, components

from rlspmd.algorithms import AGG_MODES, POLICY_LOSSES, AggArgs, rollout_correction
from rlspmd.config import (
    GDPO,
    GSPO,
    ActorConfig,
    AlgorithmConfig,
    Config,
    NativeConfig,
    RolloutCorrectionConfig,
    VllmConfig,
)
from rlspmd.validate import ignored_settings
from rlspmd.validate import config_problems
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.roles.rollout_correction import (
    RolloutCorrectionStage,
    check_bypass,
    resolve_rollout_correction,
)

F64 = torch.float64
NAN = math.nan


def t(x):
    return torch.tensor(x, dtype=F64)


# Two sequences; row 0 has 3 valid tokens, row 1 has 2; padding holds garbage (-inf, NaN) that must not be read.
#   delta = log pi_train - log pi_rollout: row 0 (0.2, -1.0, 0.0), row 1 (-0.1, 0.0)
#   token ratios: e^0.2 = 1.2214, e^-1 = 0.3679, 1, e^-0.1 = 0.9048, 1
#   sequence (geometric mean) ratios: row 0 e^(-0.8/3) = 0.7659, row 1 e^(-0.05) = 0.9512
TRAIN = t([[-1.0, -2.0, -0.5, -math.inf], [-1.0, -1.5, NAN, -math.inf]])
ROLLOUT = t([[-1.2, -1.0, -0.5, NAN], [-0.9, -1.5, 3.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
R = [math.exp(0.2), math.exp(-1.0), 1.0, math.exp(-0.1), 1.0]  # valid tokens in row order
SEQ = [math.exp(-0.8 / 3), math.exp(-0.05)]


def mean(c, name):
    total, count = c.means[name]
    return (total / count).item()


def correct(mode, level, **kw):
    return rollout_correction(TRAIN, ROLLOUT, MASK, mode=mode, level=level, **kw)


def test_token_level_truncation_rejection_and_both():
    # tis at 1.1: weights min(r, 1.1); nothing rejected.
    c = correct("tis", "token", tis_threshold=1.1, mis_lower=0.5, mis_upper=2.0)
    assert_close(c.weights_BT, t([[1.1, R[1], 1.0, 0], [R[3], 1.0, 0, 0]]))
    assert torch.equal(c.mask_BT, MASK)
    # mis in [0.5, 2]: row 0 t1 (ratio 0.3679) leaves the mask; the weights are 1 on the kept tokens.
    c = correct("mis", "token", tis_threshold=1.1, mis_lower=0.5, mis_upper=2.0)
    assert_close(c.weights_BT, t([[1.0, 0, 1.0, 0], [1.0, 1.0, 0, 0]]))
    assert torch.equal(c.mask_BT, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]]))
    assert c.mask_BT.dtype == MASK.dtype
    # both: truncated weights on the kept tokens.
    c = correct("both", "token", tis_threshold=1.1, mis_lower=0.5, mis_upper=2.0)
    assert_close(c.weights_BT, t([[1.1, 0, 1.0, 0], [R[3], 1.0, 0, 0]]))
    assert torch.equal(c.mask_BT, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]]))
    # off: weights 1, mask unchanged.
    c = correct("off", "token")
    assert_close(c.weights_BT, MASK.to(F64))
    assert torch.equal(c.mask_BT, MASK)


def test_token_level_metrics_hand_computed():
    c = correct("both", "token", tis_threshold=1.1, mis_lower=0.5, mis_upper=2.0, ratio_bound=1.1)
    assert mean(c, "is_ratio_mean") == pytest.approx(sum(R) / 5)
    assert c.maxima["is_ratio_max"].item() == pytest.approx(R[0])
    assert c.minima["is_ratio_min"].item() == pytest.approx(R[1])
    assert mean(c, "is_weight_mean") == pytest.approx((1.1 + 1.0 + R[3] + 1.0) / 4)  # the 4 kept tokens
    assert mean(c, "truncated_frac") == pytest.approx(1 / 5)  # e^0.2 > 1.1
    assert mean(c, "masked_frac") == pytest.approx(1 / 5) and mean(c, "masked_token_frac") == pytest.approx(1 / 5)
    # KL(pi_rollout || pi_train) per token: k1 = mean(log pi_rollout - log pi_train) = -(0.2 - 1 - 0.1) / 5.
    assert mean(c, "mismatch/kl_k1") == pytest.approx(0.9 / 5)
    # k3 = mean(r - log r - 1) over the 5 tokens.
    k3 = (R[0] - 0.2 - 1) + (R[1] + 1 - 1) + 0 + (R[3] + 0.1 - 1) + 0
    assert mean(c, "mismatch/kl_k3") == pytest.approx(k3 / 5)
    # log-PPL difference per sequence = mean log pi_rollout - mean log pi_train: row 0 0.8/3, row 1 0.05.
    assert mean(c, "mismatch/log_ppl_diff") == pytest.approx((0.8 / 3 + 0.05) / 2)
    assert mean(c, "mismatch/log_ppl_abs_diff") == pytest.approx((0.8 / 3 + 0.05) / 2)
    assert c.maxima["mismatch/log_ppl_abs_diff_max"].item() == pytest.approx(0.8 / 3)
    # Ratios outside [1/1.1, 1.1] = [0.909, 1.1]: e^0.2, e^-1, e^-0.1 -> 3 of 5.
    assert mean(c, "mismatch/ratio_out_of_bound_frac") == pytest.approx(3 / 5)
    # Counts are there for a global mean over ranks: tokens for token-level units.
    assert c.means["is_ratio_mean"][1].item() == 5 and c.means["mismatch/log_ppl_diff"][1].item() == 2


def test_sequence_level_uses_the_geometric_mean_of_token_ratios():
    # Band [0.9, 1.1]: row 0 (0.7659) is rejected whole, row 1 (0.9512) stays; cap 0.95 truncates row 1's weight.
    c = correct("both", "sequence", tis_threshold=0.95, mis_lower=0.9, mis_upper=1.1)
    assert_close(c.weights_BT, t([[0, 0, 0, 0], [0.95, 0.95, 0, 0]]))
    assert torch.equal(c.mask_BT, torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0]]))
    assert mean(c, "is_ratio_mean") == pytest.approx(sum(SEQ) / 2)
    assert mean(c, "truncated_frac") == pytest.approx(1 / 2)
    assert mean(c, "masked_frac") == pytest.approx(1 / 2)
    assert mean(c, "masked_token_frac") == pytest.approx(3 / 5)
    assert mean(c, "is_weight_mean") == pytest.approx(0.95)  # the one kept sequence
    # tis alone: every token of a row carries its sequence's weight.
    c = correct("tis", "sequence", tis_threshold=2.0)
    assert_close(c.weights_BT, t([[SEQ[0]] * 3 + [0], [SEQ[1]] * 2 + [0, 0]]))
    # The default band is verl's geometric preset, +-0.1%: both rows are outside it.
    c = correct("mis", "sequence")
    assert torch.equal(c.mask_BT, torch.zeros_like(MASK))


def test_metrics_do_not_depend_on_the_mode():
    ref = correct("off", "token", tis_threshold=1.1, mis_lower=0.5, mis_upper=2.0)
    for mode in ("tis", "mis", "both"):
        c = correct(mode, "token", tis_threshold=1.1, mis_lower=0.5, mis_upper=2.0)
        for name in ("is_ratio_mean", "truncated_frac", "masked_frac", "mismatch/kl_k1", "mismatch/kl_k3"):
            assert mean(c, name) == pytest.approx(mean(ref, name)), (mode, name)


def test_identical_log_probs_give_no_correction():
    c = rollout_correction(TRAIN, TRAIN, MASK, mode="both", level="sequence")
    assert torch.equal(c.mask_BT, MASK)
    assert_close(c.weights_BT, MASK.to(F64))
    assert mean(c, "mismatch/kl_k1") == 0 and mean(c, "mismatch/kl_k3") == 0 and mean(c, "masked_frac") == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="mode 'ppo'"):
        correct("ppo", "token")
    with pytest.raises(ValueError, match="level 'word'"):
        correct("tis", "word")
    with pytest.raises(ValueError, match="mis_lower < mis_upper"):
        correct("mis", "token", mis_lower=2.0, mis_upper=0.5)
    with pytest.raises(ValueError, match="tis_threshold"):
        correct("tis", "token", tis_threshold=0.0)
    with pytest.raises(ValueError, match="share one 2-D shape"):
        rollout_correction(TRAIN[:1], ROLLOUT, MASK, mode="tis", level="token")


# ---------------------------------------------------------------------------------------------------------------
# The correction inside every policy loss and aggregation mode


LOSSES = components(clip_cov_ratio=1.0, clip_cov_lb=-10.0, clip_cov_ub=10.0, kl_cov_ratio=0.3)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.shipped()))
@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_sequence_rejection_is_dropping_the_rows_and_weights_scale_them(name, mode):
    """Rejected sequences leave the loss exactly as if they had never been in the batch; the kept rows carry their
    sequence weight, which for every token-additive loss is the same as scaling each row's advantage."""
    g = torch.Generator().manual_seed(5)
    B, T = 6, 4
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[:, 0] = 1
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2
    logp = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).contiguous()
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    c = rollout_correction(
        old, rollout, mask, mode="both", level="sequence", tis_threshold=1.05, mis_lower=0.8, mis_upper=1.25
    )
    kept = c.mask_BT.any(-1)
    assert 0 < int(kept.sum()) < B  # the test must reject something and keep something

    x = logp.clone().requires_grad_()
    agg = AggArgs.from_mask(c.mask_BT.to(F64), mode=mode, norm_length=T)
    loss, _ = bound(LOSSES[name])(x, old, adv, c.mask_BT.to(F64), agg=agg, weights_BT=c.weights_BT)
    loss.backward()

    y = logp[kept].clone().requires_grad_()
    sub_mask = mask[kept].to(F64)
    sub_agg = AggArgs.from_mask(sub_mask, mode=mode, norm_length=T)
    want, _ = bound(LOSSES[name])(y, old[kept], adv[kept], sub_mask, agg=sub_agg, weights_BT=c.weights_BT[kept])
    want.backward()
    assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert_close(x.grad[kept], y.grad, rtol=1e-12, atol=1e-12)
    assert torch.all(x.grad[~kept] == 0)


# ---------------------------------------------------------------------------------------------------------------
# Config, auto resolution, bypass, the stage


def resolve(cfg=None, **kw):
    facts = {
        "engine": NativeConfig(),
        "rollout_dtype": "auto",
        "actor_compute_dtype": "float32",
        "placement": "colocated",
    }
    return resolve_rollout_correction(cfg or RolloutCorrectionConfig(), **(facts | kw))


def test_auto_is_off_only_for_the_native_engine_in_the_actors_dtype():
    assert resolve().mode == "off"
    assert resolve(rollout_dtype="float32", placement="split").mode == "off"  # a bit-exact copy of the weights
    on = resolve(rollout_dtype="bfloat16")
    assert (on.mode, on.level) == ("mis", "sequence") and "bfloat16" in on.reason
    assert (on.mis_lower, on.mis_upper) == (0.999, 1.001)  # verl's geometric rejection band
    assert resolve(engine=VllmConfig(), rollout_dtype="bfloat16", actor_compute_dtype="bfloat16").mode == "mis"
    stale = resolve(max_staleness=1, placement="split")  # stale weights: truncation, not the narrow rejection band
    assert (stale.mode, stale.level) == ("tis", "sequence") and "1 update(s) stale" in stale.reason
    assert resolve(engine=VllmConfig(), max_staleness=2, placement="split").mode == "tis"
    token = resolve(RolloutCorrectionConfig(level="token"), engine=VllmConfig())
    assert (token.level, token.mis_lower, token.mis_upper) == ("token", 0.5, 2.0)
    # An explicit mode is kept, whatever the engine.
    assert resolve(RolloutCorrectionConfig(mode="tis")).mode == "tis"
    assert resolve(RolloutCorrectionConfig(mode="off"), engine=VllmConfig()).mode == "off"
    with pytest.raises(ValueError, match="actor compute dtype"):
        resolve(actor_compute_dtype="auto")


def test_config_validation_names_the_field():
    def problems(rc: RolloutCorrectionConfig) -> list[str]:
        return config_problems(
            Config(algorithm=AlgorithmConfig(rollout_correction=rc)), world_size=1, check_files=False
        )

    assert problems(RolloutCorrectionConfig(mis_lower=1.2, tis_threshold=0.0, metric_ratio_bound=1.0)) == [
        "algorithm.rollout_correction.tis_threshold=0.0: must be > 0",
        "algorithm.rollout_correction.mis_lower=1.2: and mis_upper=None must satisfy 0 < lower < upper (with the "
        "sequence level's defaults: 1.2, 1.001)",  # above the sequence default upper 1.001
        "algorithm.rollout_correction.metric_ratio_bound=1.0: must be > 1",
    ]
    assert problems(RolloutCorrectionConfig(level="token", mis_lower=1.2)) == []  # the token level's upper is 2.0
    cfg = Config(
        algorithm=AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(mode="mis", tis_threshold=3.0)),
        actor=ActorConfig(policy_loss=GSPO(), loss_agg_mode="token-mean"),
    )
    warned = "\n".join(ignored_settings(cfg))
    assert "tis_threshold is set but mode='mis'" in warned and "does not apply to the gspo policy loss" in warned
    gdpo = Config(algorithm=AlgorithmConfig(adv_estimator=GDPO(), use_kl_in_reward=True))
    assert any("does not reach gdpo" in w for w in ignored_settings(gdpo))


def test_bypass_needs_one_update_per_step_and_the_correction_on():
    on = resolve(RolloutCorrectionConfig(mode="tis", bypass=True))
    check_bypass(on, ppo_epochs=1, mini_batch_size=32, train_batch_size=32)
    with pytest.raises(ValueError, match="actor.ppo_epochs=2"):
        check_bypass(on, ppo_epochs=2, mini_batch_size=32, train_batch_size=32)
    with pytest.raises(ValueError, match="actor.mini_batch_size=16"):
        check_bypass(on, ppo_epochs=1, mini_batch_size=16, train_batch_size=32)
    with pytest.raises(ValueError, match="mode resolved to 'off'"):
        check_bypass(
            resolve(RolloutCorrectionConfig(bypass=True)), ppo_epochs=1, mini_batch_size=32, train_batch_size=32
        )
    check_bypass(resolve(), ppo_epochs=4, mini_batch_size=8, train_batch_size=32)  # bypass off: nothing to check


def test_stage_adds_weights_applies_the_mask_and_reports_metrics():
    resolved = resolve(
        RolloutCorrectionConfig(mode="both", level="token", tis_threshold=1.1, mis_lower=0.5, mis_upper=2.0)
    )
    batch = Batch(
        {"old_logprobs_BR": TRAIN.clone(), "rollout_logprobs_BR": ROLLOUT.clone(), "loss_mask_BR": MASK.clone()}
    )
    metrics = MetricBuffer()
    out = RolloutCorrectionStage(resolved)(batch, metrics)
    assert torch.equal(out["loss_mask_BR"], torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]]))
    assert_close(out["rollout_is_weights_BR"], t([[1.1, 0, 1.0, 0], [R[3], 1.0, 0, 0]]))
    m = metrics.reduce(mesh=None)
    assert m["rollout_corr/masked_frac"] == pytest.approx(1 / 5)
    assert m["rollout_corr/mismatch/kl_k1"] == pytest.approx(0.9 / 5)
    assert m["rollout_corr/is_ratio_max"] == pytest.approx(R[0])
    assert m["rollout_corr/is_ratio_min"] == pytest.approx(R[1])
