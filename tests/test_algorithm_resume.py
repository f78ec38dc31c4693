"""Exact resume with the algorithm state this issue adds: the critic (weights, AdamW, schedule), the adaptive
in-reward KL controller, and dynamic sampling's extra draws from the data sampler (2 ranks, Gloo, tiny model)."""

from __future__ import annotations

import pytest

from conftest import torchrun
from rl_run import assert_same_state, checkpoint_tensors, metrics, rl_args, write_reward

pytestmark = pytest.mark.dist

PPO_DAPO = [
    "algorithm.adv-estimator:gae",
    "--algorithm.adv-estimator.lam",
    "0.95",
    "--critic.mini-batch-size",
    "2",
    "--critic.micro-batch-size",
    "4",
    "--critic.optim.lr",
    "1e-3",
    "--critic.warmup-steps",
    "1",
    "--actor.no-use-kl-loss",
    "--algorithm.use-kl-in-reward",
    "algorithm.kl-ctrl:adaptive",
    "--algorithm.kl-ctrl.kl-coef",
    "0.05",
    "--algorithm.kl-ctrl.target-kl",
    "0.001",
    "--algorithm.kl-ctrl.horizon",
    "4",
    "--algorithm.filter-groups.enable",
    "--algorithm.filter-groups.max-rounds",
    "2",
]


@pytest.mark.slow
def test_ppo_with_kl_controller_and_dynamic_sampling_resumes_bit_identically(tiny_model, arithmetic_data, tmp_path):
    reward = write_reward(tmp_path)
    ref_out, out = tmp_path / "reference", tmp_path / "resumed"
    torchrun(rl_args(tiny_model, arithmetic_data, ref_out, reward=reward, extra=PPO_DAPO), 2)
    args = rl_args(tiny_model, arithmetic_data, out, reward=reward, extra=PPO_DAPO)
    assert "stopped after step 2" in torchrun([*args, "--trainer.stop-at-step", "2"], 2).stdout
    assert "resumed from" in torchrun([*args, "--resume", "auto"], 2).stdout

    ref_metrics, got = metrics(ref_out), metrics(out)
    assert got == ref_metrics
    coefs = [m["kl_in_reward/coef"] for m in got if "kl_in_reward/coef" in m]
    assert len(set(coefs)) == len(coefs) == 4  # the controller moved every step, and resumed where it was
    assert [("actor/grad_norm" in m) for m in got if m["step"]] == [False, True, True, True]  # critic warm-up
    ref = checkpoint_tensors(ref_out / "checkpoints" / "step_00000004")
    assert any(k.startswith("critic.") for k in ref), sorted(ref)[:20]
    assert_same_state(ref, checkpoint_tensors(out / "checkpoints" / "step_00000004"))
