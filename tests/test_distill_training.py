"""On-policy distillation end to end under torchrun (2 ranks, Gloo, tiny models): a run with a teacher (and the
reference, both on) stops and resumes bit-identically; a teacher equal to the student gives no signal, through the
reverse KL on the advantage and through GKD's JSD term; GKD's pure distillation (no reward) trains."""

from __future__ import annotations

import pytest

from conftest import load_script, torchrun
from rl_run import assert_same_state, checkpoint_tensors, metrics, rl_args, write_reward

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory):
    """Another tiny model with the quickstart tiny model's tokenizer: 2 layers, other random weights."""
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("teacher") / "model", num_layers=2, seed=7
    )


@pytest.mark.slow
def test_a_run_with_a_teacher_resumes_bit_identically(tiny_model, teacher_model, arithmetic_data, tmp_path):
    """GRPO plus the teacher's reverse KL on the advantage, the reference's KL loss on too: stopped after step 2 and
    resumed, every metric of every step and the final checkpoint equal a run that did not stop."""
    reward = write_reward(tmp_path)
    extra = ["--teacher.model-path", str(teacher_model), "teacher.signal:reverse-kl", "--teacher.signal.kl-coef", "0.5"]
    ref_out, out = tmp_path / "reference", tmp_path / "resumed"
    torchrun(rl_args(tiny_model, arithmetic_data, ref_out, reward=reward, extra=extra), 2)
    args = rl_args(tiny_model, arithmetic_data, out, reward=reward, extra=extra)
    assert "stopped after step 2" in torchrun([*args, "--trainer.stop-at-step", "2"], 2).stdout
    assert "resumed from" in torchrun([*args, "--resume", "auto"], 2).stdout

    ref_metrics, got = metrics(ref_out), metrics(out)
    assert got == ref_metrics
    steps = [m for m in got if m["step"]]
    assert all(m["teacher/kl"] > 0 and 0 <= m["teacher/argmax_share"] <= 1 for m in steps), steps
    assert all("actor/kl_loss" in m for m in steps)  # the reference is on too
    assert_same_state(
        checkpoint_tensors(ref_out / "checkpoints" / "step_00000004"),
        checkpoint_tensors(out / "checkpoints" / "step_00000004"),
    )


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_gives_no_signal(tiny_model, arithmetic_data, tmp_path):
    """Pure distillation (no reward at all) from the student's own weights: the reverse KL is 0 at every token, so
    every advantage is 0 and the update (one per step) has a zero gradient; GKD's JSD is 0 too (up to float
    rounding)."""
    common = [  # options given twice on a line must come before the subcommands (tyro)
        "--actor.mini-batch-size",
        "4",
        "--trainer.total-steps",
        "1",
        "--trainer.val-every",
        "0",
        "--trainer.no-val-before-train",
        "--reward.rule-weight",
        "0",
        "--actor.no-use-kl-loss",
        "--teacher.model-path",
        str(tiny_model),
        "algorithm.adv-estimator:none",
    ]
    torchrun(rl_args(tiny_model, arithmetic_data, tmp_path / "rkl", extra=common), 2)
    (step,) = [m for m in metrics(tmp_path / "rkl") if m["step"]]
    assert step["teacher/kl"] == 0 and 0 <= step["teacher/argmax_share"] <= 1
    assert step["adv/max"] == step["adv/min"] == 0 and step["actor/grad_norm"] == 0
    assert step["reward/mean"] == 0  # nothing scored the samples

    gkd = [*common, "teacher.signal:gkd", "--teacher.signal.beta", "0.5"]
    torchrun(rl_args(tiny_model, arithmetic_data, tmp_path / "gkd", extra=gkd), 2)
    (step,) = [m for m in metrics(tmp_path / "gkd") if m["step"]]
    assert abs(step["teacher/jsd"]) < 1e-6 and abs(step["teacher/kl"]) < 1e-6
    assert step["actor/grad_norm"] < 1e-4


@pytest.mark.slow
def test_gkd_pure_distillation_moves_the_student_to_the_teacher(tiny_model, teacher_model, arithmetic_data, tmp_path):
    """GKD alone (no reward, zero advantages): the JSD to another model falls over a few updates on the same prompts
    (the student's samples move, so the measure is the divergence on fresh samples each step)."""
    extra = [
        "--actor.ppo-epochs",
        "2",
        "--trainer.total-steps",
        "4",
        "--trainer.val-every",
        "0",
        "--trainer.no-val-before-train",
        "--checkpoint.save-every",
        "0",
        "--reward.rule-weight",
        "0",
        "--actor.no-use-kl-loss",
        "--teacher.model-path",
        str(teacher_model),
        "algorithm.adv-estimator:none",
        "teacher.signal:gkd",
        "--teacher.signal.beta",
        "0.5",
    ]
    torchrun(rl_args(tiny_model, arithmetic_data, tmp_path / "gkd", extra=extra), 2)
    jsd = [m["teacher/jsd"] for m in metrics(tmp_path / "gkd") if m["step"]]
    assert len(jsd) == 4 and all(j > 0 for j in jsd)
    assert jsd[-1] < 0.7 * jsd[0], jsd


@pytest.mark.slow
def test_distillation_of_multi_turn_agent_rollouts(tool_caller, tiny_tools_model, tmp_path):
    """Tool-calling conversations (tool results inside the responses, out of the loss mask) distilled with GKD on top
    of GRPO: the teacher scores the same micro-batches, the JSD counts the model's tokens only."""
    model, data = tool_caller
    out = tmp_path / "run"
    args = [
        "-m",
        "rlspmd.train",
        "--actor.model.path",
        str(model),
        "--data.train-files",
        str(data / "train.parquet"),
        "--data.val-files",
        str(data / "test.parquet"),
        "--data.train-batch-size",
        "4",
        "--actor.mini-batch-size",
        "4",
        "--actor.micro-batch-size",
        "4",
        "--rollout.n",
        "2",
        "--rollout.max-response-length",
        "160",
        "--rollout.temperature",
        "0.5",
        "--rollout.agent.tools",
        "calculator",
        "--rollout.agent.max-turns",
        "3",
        "--trainer.total-steps",
        "1",
        "--trainer.val-every",
        "0",
        "--trainer.no-val-before-train",
        "--trainer.output-dir",
        str(out),
        "--trainer.loggers",
        "jsonl",
        "--checkpoint.no-save-final",
        "--teacher.model-path",
        str(tiny_tools_model),
        "teacher.signal:gkd",
    ]
    torchrun(args, 2, timeout=600)
    (step,) = [m for m in metrics(out) if m["step"]]
    assert step["agent/tool_calls"] > 0 and step["agent/masked_token_share"] > 0  # tool results were in responses
    assert step["teacher/jsd"] > 0 and 0 <= step["teacher/argmax_share"] < 1  # a random teacher disagrees
    assert step["actor/grad_norm"] > 0
