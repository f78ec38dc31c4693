"""The Clip-Cov, KL-Cov and GDPO recipes (``configs/{clip_cov,kl_cov,gdpo}.py``): a GPU-scale ``config`` and a
``cpu()`` variant each; Clip-Cov and KL-Cov run end to end for two steps on 2 CPU ranks (Gloo) from the quickstart's
warm start; GDPO (two rewards: the task's correctness and the answer format) must raise both over a short run."""

import json
from pathlib import Path

import pytest

from conftest import ROOT, torchrun, val_answer_format
from rlspmd.config import load_config_file
from rlspmd.validate import ignored_settings

RECIPES = {"clip_cov": ("grpo", "clip_cov"), "kl_cov": ("grpo", "kl_cov"), "gdpo": ("gdpo", "ppo_clip")}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_has_a_gpu_config_and_a_cpu_variant(name):
    gpu, cpu = load_config_file(ROOT / f"configs/{name}.py"), load_config_file(ROOT / f"configs/{name}.py:cpu")
    estimator, loss = RECIPES[name]
    for cfg in (gpu, cpu):
        assert (cfg.algorithm.adv_estimator.name, cfg.actor.policy_loss.name) == (estimator, loss), name
        assert ignored_settings(cfg) == [], name  # every field the recipe sets does something
    assert gpu.actor.model.path != cpu.actor.model.path
    assert gpu.data.train_files == ["data/gsm8k/train.parquet"]
    if name == "gdpo":
        assert gpu.algorithm.adv_estimator.reward_weights == cpu.algorithm.adv_estimator.reward_weights == [1.0, 0.5]


def run_recipe(name: str, out: Path, warm_start: Path, data: Path, steps: int, *, validate: bool = False) -> list[dict]:
    """``validate``: greedy validation before training and after the last step (the 200 held-out prompts, every
    answer in the sample log)."""
    val = (
        ["--trainer.val-every", str(steps), "--trainer.samples.num-val", "200"]
        if validate
        else ["--trainer.val-every", "0", "--trainer.no-val-before-train"]
    )
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
            "--trainer.total-steps",
            str(steps),
            *val,
        ],
        2,
        timeout=900,
    )
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("name, metric", [("clip_cov", "actor/cov_clip_frac"), ("kl_cov", "actor/kl_cov_frac")])
def test_covariance_recipes_train(name, metric, warm_start, quickstart_data, tmp_path):
    rows = run_recipe(name, tmp_path, warm_start, quickstart_data, steps=2)
    assert len(rows) == 2
    for r in rows:
        # At least one token per micro-batch is selected (the loss's minimum), never all of them.
        assert 0 < r[metric] < 0.5, (name, r[metric])
        assert r["actor/grad_norm"] > 0 and "actor/clip_frac_upper" in r and "actor/clip_frac_lower" in r


@pytest.mark.slow
@pytest.mark.dist
def test_gdpo_raises_both_rewards_and_validation_accuracy(warm_start, quickstart_data, tmp_path):
    """``configs/gdpo.py:cpu`` as written, shortened to 12 steps: each reward is normalised in its group, weighted
    (1, 0.5) and whitened; the warm start answers in the wrong style 70% of the time, so the format reward has
    signal of its own. Greedy validation answers move to the accepted style, their accuracy rises off 0 and both
    training rewards rise (the measures of ``tests/test_algorithm_configs.py``)."""
    steps, k = 12, 4
    rows = run_recipe("gdpo", tmp_path, warm_start, quickstart_data, steps, validate=True)
    val = {r["step"]: r["val/acc"] for r in rows if "val/acc" in r}
    style = val_answer_format(tmp_path)
    train = [r for r in rows if r["step"] > 0]
    assert len(train) == steps and sorted(val) == sorted(style) == [0, steps]
    rise = {}
    for key in ("reward/task_score", "reward/component/answer_format"):
        series = [r[key] for r in train]
        rise[key] = sum(series[-k:]) / k - sum(series[:k]) / k
    print(
        f"gdpo: val/acc {val[0]:.3f} -> {val[steps]:.3f}; accepted answer style {style[0]:.3f} -> {style[steps]:.3f}; "
        f"training reward rise (last {k} - first {k} steps) {rise}"
    )
    assert style[0] <= 0.1 and style[steps] >= 0.9, f"accepted answer style {style[0]:.3f} -> {style[steps]:.3f}"
    assert val[steps] >= val[0] + 0.04, f"validation accuracy {val[0]:.3f} -> {val[steps]:.3f}"
    assert rise["reward/component/answer_format"] >= 0.2 and rise["reward/task_score"] > 0, rise
