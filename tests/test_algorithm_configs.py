"""Every algorithm config's CPU variant (``configs/<name>.py:cpu``) end to end under torchrun, 2 ranks (Gloo), on the
quickstart's warm start; PPO, GRPO, DAPO, RLOO and REINFORCE++ must raise the task's reward over a short run.

The learning runs use the configs as written, shortened to 12 steps. The warm start answers greedily in a style the
checker rejects (``configs/quickstart.py``), so greedy validation accuracy on the held-out split starts at 0; the
measures are the style of the greedy answers (0 -> 1, far from noise), the accuracy rising off 0, and the sampled
training reward (a noisy 256-sample estimate) rising; see ``conftest.val_answer_format``.
"""

import json
from pathlib import Path

import pytest

from conftest import ROOT, torchrun, val_answer_format

pytestmark = pytest.mark.dist

ALGORITHM_CONFIGS = ("ppo", "grpo", "dapo", "rloo", "reinforce_pp", "remax", "gspo")


def run_config(name: str, out: Path, warm_start: Path, data: Path, *overrides: str) -> list[dict]:
    """``configs/<name>.py:cpu`` on 2 ranks with the test's model and data; the metrics rows of metrics.jsonl."""
    torchrun(
        [
            "-m",
            "rlspmd.train",
            "--config",
            f"configs/{name}.py:cpu",
            "--actor.model.path",
            str(warm_start),
            "--data.train-files",
            str(data / "train.parquet"),
            "--data.val-files",
            str(data / "test.parquet"),
            "--trainer.output-dir",
            str(out),
            "--trainer.loggers",
            "jsonl",
            *overrides,
        ],
        2,
        timeout=600,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_algorithm_has_a_gpu_config_and_a_cpu_variant():
    from rlspmd.config import load_config_file

    for name in ALGORITHM_CONFIGS:
        gpu, cpu = load_config_file(ROOT / f"configs/{name}.py"), load_config_file(ROOT / f"configs/{name}.py:cpu")
        assert gpu.actor.model.path != cpu.actor.model.path, name
        assert (
            gpu.algorithm.adv_estimator.name == cpu.algorithm.adv_estimator.name
            and gpu.actor.policy_loss.name == cpu.actor.policy_loss.name
        ), name
        assert gpu.data.train_files == ["data/gsm8k/train.parquet"], name
    with pytest.raises(ValueError, match="has no `gpu`"):
        load_config_file(f"{ROOT}/configs/grpo.py:gpu")


def test_config_file_selector_picks_an_instance_or_a_function(tmp_path):
    from rlspmd.config import RolloutConfig, load_config_file
    from rlspmd.startup import parse_args

    f = tmp_path / "two.py"
    f.write_text(
        "from rlspmd.config import *\nconfig = Config()\nsmall = Config(rollout=RolloutConfig(n=2))\n"
        "def big():\n    return Config(rollout=RolloutConfig(n=16))\n"
    )
    assert load_config_file(f).rollout.n == RolloutConfig().n and load_config_file(f"{f}:small").rollout.n == 2
    cfg, _ = parse_args(["--config", f"{f}:big", "--rollout.n", "32"])
    assert cfg.rollout.n == 32 and parse_args(["--config", f"{f}:big"])[0].rollout.n == 16
    with pytest.raises(ValueError, match="has no `tiny` .* it defines \\['big', 'config', 'small'\\]"):
        load_config_file(f"{f}:tiny")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, steps",
    [("grpo", 12), ("ppo", 12), ("dapo", 12), ("rloo", 12), ("reinforce_pp", 12)],
)
def test_algorithm_raises_the_reward(name, steps, warm_start, quickstart_data, tmp_path):
    rows = run_config(
        name,
        tmp_path,
        warm_start,
        quickstart_data,
        "--trainer.total-steps",
        str(steps),
        "--trainer.val-every",
        str(steps),
        "--trainer.samples.num-val",
        "200",  # every validation answer, for their style
    )
    val = {r["step"]: r["val/acc"] for r in rows if "val/acc" in r}
    style = val_answer_format(tmp_path)
    # DAPO trains on the groups it kept (biased toward mixed outcomes); its task reward is over every sample drawn.
    key = "sampling/drawn_acc" if name == "dapo" else "reward/mean"
    train = [r[key] for r in rows if key in r]
    k = 4
    early, late = sum(train[:k]) / k, sum(train[-k:]) / k
    print(
        f"{name}: val/acc {val[0]:.3f} -> {val[steps]:.3f}; accepted answer style {style[0]:.3f} -> "
        f"{style[steps]:.3f}; training reward, first {k} steps {early:.3f} -> last {k} {late:.3f}"
    )
    assert len(train) == steps and sorted(style) == sorted(val) == [0, steps]
    # The rewarded behaviour the warm start lacks: greedy answers move to the accepted style (0 -> 1 by step 8).
    assert style[0] <= 0.1 and style[steps] >= 0.9, f"{name}: answer style {style[0]:.3f} -> {style[steps]:.3f}"
    # and with it the held-out reward rises off 0 (at least 8 of 200; the tiny model's arithmetic caps it near 0.1).
    assert val[steps] >= val[0] + 0.04, f"{name}: validation accuracy {val[0]:.3f} -> {val[steps]:.3f}"
    # The sampled training reward (256 samples a step, about 0.02 noise per step) rises over the run.
    assert late > early, f"{name}: training reward {early:.3f} -> {late:.3f}"


def test_remax_runs_with_its_greedy_baseline_and_a_rerendering_reward_model(
    warm_start, quickstart_data, tiny_reward_model_plain_template, tmp_path
):
    rows = run_config(
        "remax",
        tmp_path,
        warm_start,
        quickstart_data,
        "--trainer.total-steps",
        "2",
        "--trainer.val-every",
        "0",
        "--trainer.no-val-before-train",
        "--reward.model.path",
        str(tiny_reward_model_plain_template),
        "--reward.model.weight",
        "0.5",
    )
    for r in rows:
        assert r["timing/baseline"] > 0 and "reward/rm_score" in r
        assert r["reward/mean"] == pytest.approx(r["reward/task_score"] + 0.5 * r["reward/rm_score"], abs=1e-5)
        assert r["kl_in_reward/coef"] == pytest.approx(0.001)


def test_gspo_runs_off_policy_mini_batches(warm_start, quickstart_data, tmp_path):
    rows = run_config(
        "gspo",
        tmp_path,
        warm_start,
        quickstart_data,
        "--trainer.total-steps",
        "2",
        "--trainer.val-every",
        "0",
        "--trainer.no-val-before-train",
    )
    assert len(rows) == 2 and all("actor/seq_ratio_mean" in r for r in rows)


def test_ppo_critic_from_a_reward_model_with_the_actors_tokenizer(
    warm_start, quickstart_data, tiny_reward_model, tmp_path
):
    rows = run_config(
        "ppo",
        tmp_path,
        warm_start,
        quickstart_data,
        "--trainer.total-steps",
        "3",
        "--trainer.val-every",
        "0",
        "--trainer.no-val-before-train",
        "--critic.model-path",
        str(tiny_reward_model),
        "--critic.warmup-steps",
        "2",
        "--reward.model.path",
        str(tiny_reward_model),
        "--reward.rule-weight",
        "0.0",
    )
    assert [("actor/grad_norm" in r) for r in rows] == [False, False, True]  # critic warm-up: actor waits 2 steps
    assert all(r["critic/grad_norm"] > 0 and r["reward/task_score"] == 0.0 for r in rows)
    assert all(r["reward/mean"] == pytest.approx(r["reward/rm_score"], abs=1e-6) for r in rows)
