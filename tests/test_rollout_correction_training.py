"""Rollout correction in training: where the update's old log-probs come from (recomputed, the update's own forward,
or the rollout's in bypass mode), and the weights, mask and denominators each path hands the policy loss, against
hand-computed values on one fixed batch, for every policy loss and aggregation mode; the builder's decisions; and
short runs of the trainer with the correction on, inside the loss and in bypass mode (1 rank, Gloo)."""

import json
import math

import pytest
import torch
from torch.testing import assert_close

from conftest import torchrun
from loss_options import bound, components
from rlspmd.algorithms import AGG_MODES, POLICY_LOSSES, AggArgs
from rlspmd.config import ActorConfig, Config, DataConfig, NativeConfig, RolloutConfig, RolloutCorrectionConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.roles.policy import policy_gradient_inputs
from rlspmd.trainer.build_rollout import build_rollout_correction
from rlspmd.trainer.build_models import old_logprob_source
from rlspmd.roles.rollout_correction import RolloutCorrectionStage, resolve_rollout_correction

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


# The fixed batch. Two samples, 3 and 2 valid tokens (padding holds values that must never be read).
#   log pi_train (the behaviour policy under the trainer = the step's single update at its start) and log pi_rollout;
#   delta = train - rollout: row 0 (0.2, -1.0, 0.0), row 1 (-0.1, 0.0); token ratios e^0.2, e^-1, 1 | e^-0.1, 1.
TRAIN = t([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.5, 0.0, 0.0]])
ROLLOUT = t([[-1.2, -1.0, -0.5, 7.0], [-0.9, -1.5, 7.0, 7.0]])
MASK = t([[1, 1, 1, 0], [1, 1, 0, 0]])
ADV = t([[1.0] * 4, [-0.5] * 4])
# Token level, mode both, cap 1.1, band [0.5, 2]: row 0 token 1 (ratio e^-1) is rejected, row 0 token 0 truncated.
CORRECTED_MASK = t([[1, 0, 1, 0], [1, 1, 0, 0]])
WEIGHTS = t([[1.1, 0, 1.0, 0], [math.exp(-0.1), 1.0, 0, 0]])
LOSSES = components(clip_cov_ratio=1.0, clip_cov_lb=-10.0, clip_cov_ub=10.0, kl_cov_ratio=0.3)


def resolved(**kw):
    cfg = RolloutCorrectionConfig(
        **({"mode": "both", "level": "token", "tis_threshold": 1.1, "mis_lower": 0.5, "mis_upper": 2.0} | kw)
    )
    return resolve_rollout_correction(
        cfg, engine=NativeConfig(), rollout_dtype="bfloat16", actor_compute_dtype="float32", placement="colocated"
    )


def micro_batch(**extra):
    return Batch(
        {
            "rollout_logprobs_BR": ROLLOUT.clone(),
            "response_mask_BR": MASK.clone(),
            "loss_mask_BR": MASK.clone(),
            "advantages_BR": ADV.clone(),
            **extra,
        }
    )


def inputs(source, mb, logp, metrics=None, **kw):
    return policy_gradient_inputs(
        mb,
        logp,
        mb["loss_mask_BR"],
        old_logprobs=source,
        correction=resolved(**kw),
        metrics=metrics if metrics is not None else MetricBuffer(),
    )


def ppo_token_mean(logp, old, mask, weights, *, denominator):
    loss, _ = bound(LOSSES["ppo_clip"])(
        logp,
        old,
        ADV,
        mask,
        agg=AggArgs(mode="token-mean", global_tokens=denominator, global_seqs=2),
        weights_BT=weights,
    )
    return loss


def test_update_path_corrects_inside_the_loss_with_the_uncorrected_denominators():
    """One update per step: pi_train is the update's own forward. Ratio 1, so ppo_clip's loss per token is -A, times
    the weight, over the kept tokens, divided by the 5 sampled tokens (the denominators stay the uncorrected mask's)."""
    logp = TRAIN.clone().requires_grad_()
    metrics = MetricBuffer()
    old, mask, weights = inputs("update", micro_batch(), logp, metrics)
    assert_close(old, TRAIN) and not old.requires_grad
    assert_close(mask, CORRECTED_MASK)
    assert_close(weights, WEIGHTS)
    loss = ppo_token_mean(logp, old, mask, weights, denominator=5)
    want = -(1.1 * 1 + 1.0 * 1 + math.exp(-0.1) * -0.5 + 1.0 * -0.5) / 5
    assert loss.item() == pytest.approx(want, abs=1e-12)
    loss.backward()
    assert_close(logp.grad, t([[-1.1, 0, -1.0, 0], [0.5 * math.exp(-0.1), 0.5, 0, 0]]) / 5)
    m = metrics.reduce(mesh=None)  # the correction's metrics and the rollout/trainer gap, from this micro-batch
    assert m["rollout_corr/masked_frac"] == pytest.approx(1 / 5)
    assert m["rollout_corr/truncated_frac"] == pytest.approx(1 / 5)
    assert m["rollout_corr/mismatch/kl_k1"] == pytest.approx(0.9 / 5)
    assert m["rollout/logprob_gap"] == pytest.approx((0.2 + 1.0 + 0.0 + 0.1 + 0.0) / 5)


def test_recompute_path_uses_the_stage_once_and_its_mask_in_the_denominators():
    """Old log-probs recomputed: the step's stage adds the weights and takes the rejected token out of the loss
    mask, which the update's denominators then count (4 tokens)."""
    batch = micro_batch(old_logprobs_BR=TRAIN.clone())
    metrics = MetricBuffer()
    batch = RolloutCorrectionStage(resolved())(batch, metrics)
    assert_close(batch["loss_mask_BR"], CORRECTED_MASK)
    assert_close(batch["response_mask_BR"], MASK)  # every sampled position still holds its token
    assert_close(batch["rollout_is_weights_BR"], WEIGHTS)
    assert metrics.reduce(mesh=None)["rollout_corr/masked_frac"] == pytest.approx(1 / 5)
    logp = (TRAIN + 0.0).requires_grad_()  # the first update: the policy is still the behaviour policy
    loss_metrics = MetricBuffer()
    old, mask, weights = inputs("recompute", batch, logp, loss_metrics)
    assert old is batch["old_logprobs_BR"] and weights is batch["rollout_is_weights_BR"]
    assert_close(mask, CORRECTED_MASK)
    assert loss_metrics.reduce(mesh=None) == {}  # the stage recorded the metrics; the loss adds none
    denominator = int(batch["loss_mask_BR"].sum())  # what ppo_updates counts from the mini-batch
    loss = ppo_token_mean(logp, old, mask, weights, denominator=denominator)
    assert denominator == 4
    assert loss.item() == pytest.approx(-(1.1 + 1.0 - 0.5 * math.exp(-0.1) - 0.5) / 4, abs=1e-12)


def test_bypass_path_takes_the_rollout_log_probs_and_only_the_rejection():
    """Bypass: the old log-probs are the rollout's, so PPO's ratio is pi_theta / pi_rollout = e^0.2, 1 | e^-0.1, 1 on
    the kept tokens (none clipped at [0.8, 1.28]); no weights (they would count the ratio twice)."""
    batch = micro_batch(old_logprobs_BR=ROLLOUT.clone())  # what Policy.old_log_prob sets in bypass mode
    logp = TRAIN.clone().requires_grad_()
    old, mask, weights = inputs("rollout", batch, logp, bypass=True)
    assert old is batch["old_logprobs_BR"] and weights is None
    assert_close(mask, CORRECTED_MASK)
    loss = ppo_token_mean(logp, old, mask, weights, denominator=5)
    want = (-math.exp(0.2) - 1.0 + 0.5 * math.exp(-0.1) + 0.5) / 5
    assert loss.item() == pytest.approx(want, abs=1e-12)
    # tis alone in bypass rejects nothing: the loss is plain PPO against the rollout's log-probs
    _, mask, weights = inputs("rollout", batch, logp, mode="tis", bypass=True)
    assert_close(mask, MASK) and weights is None


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES.shipped()))
@pytest.mark.parametrize("mode", sorted(AGG_MODES))
@pytest.mark.parametrize("source", ["update", "recompute", "rollout"])
def test_every_policy_loss_and_aggregation_gets_the_hand_computed_correction(name, mode, source):
    """Whatever the loss and aggregation: the loss of each path is the loss function given the hand-computed old
    log-probs, mask and weights above, in value and gradient."""
    current = TRAIN + t([[0.05, -0.1, 0.02, 0.0], [-0.03, 0.04, 0.0, 0.0]])  # the policy has moved since sampling
    batch = micro_batch(old_logprobs_BR={"update": TRAIN, "recompute": TRAIN, "rollout": ROLLOUT}[source].clone())
    if source == "recompute":
        batch = RolloutCorrectionStage(resolved())(batch, MetricBuffer())
    logp = (TRAIN if source == "update" else current).clone().requires_grad_()
    old, mask, weights = inputs(source, batch, logp, bypass=source == "rollout")
    agg = AggArgs.from_mask(batch["loss_mask_BR"], mode=mode, norm_length=4)  # ppo_updates' denominators
    loss, _ = bound(LOSSES[name])(logp, old, ADV, mask, agg=agg, weights_BT=weights)
    loss.backward()

    want_old = {"update": TRAIN, "recompute": TRAIN, "rollout": ROLLOUT}[source]
    want_weights = None if source == "rollout" else WEIGHTS
    want_denominators = CORRECTED_MASK if source == "recompute" else MASK
    ref = logp.detach().clone().requires_grad_()
    want, _ = bound(LOSSES[name])(
        ref,
        want_old,
        ADV,
        CORRECTED_MASK,
        agg=AggArgs.from_mask(want_denominators, mode=mode, norm_length=4),
        weights_BT=want_weights,
    )
    want.backward()
    # (the hand weight e^-0.1 and the computed e^(-1.0 - -0.9) differ in the last bit)
    assert_close(loss, want, rtol=1e-12, atol=1e-15)
    assert_close(logp.grad, ref.grad, rtol=1e-12, atol=1e-15)
    assert torch.all(logp.grad[0, 1] == 0), "a rejected token must get no gradient"


def test_mode_off_is_bit_identical_to_no_correction():
    """``off`` (the default for the native engine in the actor's dtype): weights 1 and the mask unchanged, so every
    loss is bit for bit the uncorrected one (the loss-parity runs hold the whole trainer to that)."""
    logp = TRAIN.clone().requires_grad_()
    old, mask, weights = inputs("update", micro_batch(), logp, mode="off")
    for name, component in LOSSES.items():
        agg = AggArgs.from_mask(MASK, mode="token-mean")
        a, _ = bound(component)(logp, old, ADV, mask, agg=agg, weights_BT=weights)
        b, _ = bound(component)(logp, TRAIN, ADV, MASK, agg=agg)
        assert torch.equal(a, b), name


def test_the_builder_resolves_the_mode_and_picks_the_old_log_prob_source():
    def config(**kw):
        cfg = Config(
            rollout=RolloutConfig(**kw.pop("rollout", {})),
            data=DataConfig(train_batch_size=8),
            actor=ActorConfig(mini_batch_size=kw.pop("mini", 4)),
        )
        cfg.algorithm.rollout_correction = RolloutCorrectionConfig(**kw)
        return cfg

    off = build_rollout_correction(config(), compute=torch.float32, split=False)
    assert off.mode == "off" and "native engine" in off.summary()
    bf16 = build_rollout_correction(config(rollout={"dtype": "bfloat16"}), compute=torch.float32, split=True)
    assert (
        (bf16.mode, bf16.level) == ("mis", "sequence") and "bfloat16" in bf16.summary() and "(split)" in bf16.summary()
    )
    stale = Config()
    stale.trainer.max_staleness = 1
    assert build_rollout_correction(stale, compute=torch.float32, split=True).mode == "tis"
    bypass = build_rollout_correction(config(mode="tis", bypass=True, mini=8), compute=torch.float32, split=False)
    assert "bypass" in bypass.summary()

    a = ActorConfig()
    assert old_logprob_source(a, single_update=True, correction=bypass, use_kl_in_reward=False) == "rollout"
    assert old_logprob_source(a, single_update=True, correction=off, use_kl_in_reward=False) == "update"
    assert old_logprob_source(a, single_update=False, correction=off, use_kl_in_reward=False) == "recompute"
    assert old_logprob_source(a, single_update=True, correction=off, use_kl_in_reward=True) == "recompute"
    no_reuse = ActorConfig(reuse_update_logprobs=False)
    assert old_logprob_source(no_reuse, single_update=True, correction=off, use_kl_in_reward=False) == "recompute"


# ---------------------------------------------------------------------------------------------------------------
# The trainer with the correction on: 2 steps on 1 rank with a bf16 rollout copy (pi_rollout != pi_train)


def _run(tiny_model, arithmetic_data, out, *extra):
    from rl_run import rl_args, write_reward

    out.mkdir()
    args = rl_args(
        tiny_model,
        arithmetic_data,
        out,
        steps=2,
        reward=write_reward(out),
        extra=[
            "--rollout.dtype",
            "bfloat16",
            "--trainer.val-every",
            "0",
            "--trainer.no-val-before-train",
            "--checkpoint.save-every",
            "0",
            "--checkpoint.no-save-final",
            *extra,
        ],
    )
    proc = torchrun(args, 1)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, rows


RUNS = {
    # two updates per step: the old log-probs are recomputed and the step's stage corrects the batch
    "recompute": ["--algorithm.rollout-correction.mode", "both", "--algorithm.rollout-correction.level", "token"],
    # one update per step: the update's forward is pi_train and the loss corrects itself
    "update": [
        "--actor.mini-batch-size",
        "4",
        "--algorithm.rollout-correction.mode",
        "both",
        "--algorithm.rollout-correction.level",
        "token",
    ],
    # bypass: no old-log-prob forward at all
    "bypass": [
        "--actor.mini-batch-size",
        "4",
        "--algorithm.rollout-correction.mode",
        "mis",
        "--algorithm.rollout-correction.level",
        "token",
        "--algorithm.rollout-correction.bypass",
    ],
    # off: the metrics are logged anyway
    "off": ["--algorithm.rollout-correction.mode", "off"],
}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_trainer_applies_the_correction_and_logs_its_metrics(name, tiny_model, arithmetic_data, tmp_path):
    stdout, rows = _run(tiny_model, arithmetic_data, tmp_path / name, *RUNS[name])
    assert len(rows) == 2
    mode = {"recompute": "both", "update": "both", "bypass": "mis", "off": "off"}[name]
    assert f"rollout correction: {mode}" in stdout  # the resolved mode and its reason are in the run's log
    for r in rows:
        # bf16 weights against fp32 training: the two log-probs differ a little, never a lot
        assert 0 < r["rollout_corr/mismatch/kl_k3"] < 0.05 and 0 < r["rollout/logprob_gap"] < 0.1
        assert r["rollout_corr/is_ratio_min"] <= r["rollout_corr/is_ratio_mean"] <= r["rollout_corr/is_ratio_max"]
        assert 0 <= r["rollout_corr/masked_frac"] <= 1 and r["actor/grad_norm"] > 0
        if name == "off":
            assert r["rollout_corr/is_weight_mean"] == 1.0
        if name == "bypass":
            assert r["timing/old_log_prob"] < 0.05, "bypass must skip the old-log-prob forward"


@pytest.mark.slow
@pytest.mark.dist
def test_rejected_tokens_still_count_as_generated(tiny_model, arithmetic_data, tmp_path):
    """A narrow token band (+-0.1%) rejects part of every bf16 step's tokens from the loss; ``tokens/generated`` (and
    the generation throughput) still counts every token the model sampled: all the response tokens in single turn."""
    _, rows = _run(
        tiny_model,
        arithmetic_data,
        tmp_path / "reject",
        "--algorithm.rollout-correction.mode",
        "mis",
        "--algorithm.rollout-correction.level",
        "token",
        "--algorithm.rollout-correction.mis-lower",
        "0.999",
        "--algorithm.rollout-correction.mis-upper",
        "1.001",
    )
    for r in rows:
        assert 0.05 < r["rollout_corr/masked_frac"] < 1, r["rollout_corr/masked_frac"]  # tokens were rejected
        assert r["tokens/generated"] == r["tokens/response"] > 0
        gen_s = max(r["timing/gen"], r["timing/rollout/gen"])  # colocated: the stage, which contains the engine's time
        assert r["throughput/gen_tokens_per_s"] == pytest.approx(r["tokens/generated"] / gen_s)
