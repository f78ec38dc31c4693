"""The experiment trackers (``rlspmd/trackers.py``) driven directly, without training: W&B in offline mode and Trackio's
local store, each read back from what it wrote (``tests/tracker_read.py``), through a stop and a resume; and the
start-up checks. MLflow, which needs its tracking server, and the trackers under training: ``test_trackers_e2e.py``.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from rlspmd.config import Config, SFTConfig
from rlspmd.trackers import TrackerConfig, Trackers, flat_params, mlflow_name
from rlspmd.validate import config_problems, sft_config_problems
from tracker_read import trackio_config, trackio_logs, trackio_runs, wandb_runs, wandb_table

CONFIG = {
    "actor": {"optim": {"lr": 1e-06, "betas": [0.9, 0.999]}, "model": {"path": "models/tiny"}},
    "trainer": {"total_steps": 5, "loggers": ["jsonl", "wandb", "trackio"]},
    "seed": None,
}
ROWS = [
    {"prompt": "<|im_start|>user\nCalculate 1 + 2.<|im_end|>", "response": "#### 3⟦<|im_end|>⟧", "reward": 1.0},
    {"prompt": "<|im_start|>user\nCalculate 4 - 7.<|im_end|>", "response": "The answer is -3.", "reward": 0.0},
]


def step_metrics(start: int, stop: int) -> dict[int, dict]:
    """Metrics of steps [start, stop): an int, a NaN at step 1 and an inf at step 3 (which trackers do not get)."""
    return {
        s: {
            "reward/mean": 0.25 * s,
            "actor/entropy": 6.5 - s / 3,
            "actor/kl_loss": float("nan") if s == 1 else (math.inf if s == 3 else 0.01 * s),
            "tokens/total": 100 * s,
        }
        for s in range(start, stop)
    }


def table_rows(step: int) -> list[dict]:
    return [{"step": step, **r, "advantage": 0.5 * (-1) ** i if step else None} for i, r in enumerate(ROWS)]


def finite(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


def run_segment(trackers: Trackers, metrics: dict[int, dict], *, lines: list[str]) -> None:
    trackers.start(write=lines.append)
    for step, m in metrics.items():
        trackers.table("samples/train", table_rows(step), step)
        trackers.log(step, m)
    trackers.close()


def resumed(first: Trackers, loggers: list[str], cfg: TrackerConfig, output_dir) -> Trackers:
    """A new run's trackers given the first one's state as a checkpoint stores it (JSON text)."""
    second = Trackers(loggers, cfg, output_dir=str(output_dir), config=CONFIG)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    return second


def test_wandb_offline_gets_every_finite_metric_the_config_and_the_table_and_a_resume_continues_its_run(
    tracker_stores, tmp_path
):
    out, cfg, lines = tmp_path / "run_a", TrackerConfig(project="unit", offline=True), []
    first = Trackers(["console", "jsonl", "wandb"], cfg, output_dir=str(out), config=CONFIG)
    run_segment(first, step_metrics(0, 3), lines=lines)
    second = resumed(first, ["wandb"], cfg, out)
    run_segment(second, step_metrics(3, 5), lines=lines)

    runs = wandb_runs(out)
    run_id = first.runs["wandb"]
    assert [r.run_id for r in runs] == [run_id, run_id] and second.runs == {"wandb": run_id}
    assert [(r.project, r.name) for r in runs] == [("unit", "run_a")] * 2
    assert runs[0].config == CONFIG and runs[1].config == CONFIG
    assert sorted(runs[0].history) == [0, 1, 2] and sorted(runs[1].history) == [3, 4]
    for run in runs:
        for step, row in run.history.items():
            assert {k: v for k, v in row.items() if not k.startswith("samples/")} == finite(step_metrics(0, 5)[step])
            assert wandb_table(run, step, "samples/train") == table_rows(step)
    assert lines[0].startswith(f"wandb: started run {run_id} (run_a) in project unit: offline, in {out / 'wandb'}")
    assert lines[1].startswith(f"wandb: continuing run {run_id} (run_a)")
    assert len(lines) == 2, lines  # no warning


def test_trackio_local_store_gets_every_finite_metric_the_config_and_the_table_and_a_resume_continues_its_run(
    tracker_stores, tmp_path
):
    project = "unit-trackio"
    out, cfg, lines = tmp_path / "run_b", TrackerConfig(project=project, run_name="seg", offline=True), []
    first = Trackers(["trackio"], cfg, output_dir=str(out), config=CONFIG)
    run_segment(first, step_metrics(0, 3), lines=lines)
    other = Trackers(["trackio"], cfg, output_dir=str(out), config=CONFIG)  # a fresh run of the same name: a new run
    run_segment(other, step_metrics(0, 1), lines=[])
    second = resumed(first, ["trackio"], cfg, out)
    run_segment(second, step_metrics(3, 5), lines=lines)

    mine, theirs = first.runs["trackio"], other.runs["trackio"]
    assert mine["name"] == "seg" and theirs["name"] == "seg-2" and second.runs["trackio"] == mine
    assert sorted((r["name"], r["id"]) for r in trackio_runs(project)) == [("seg", mine["id"]), ("seg-2", theirs["id"])]
    logs = trackio_logs(project, mine["id"])
    assert sorted(logs) == [0, 1, 2, 3, 4]
    for step, row in logs.items():
        table = row.pop("samples/train")
        assert row == finite(step_metrics(0, 5)[step])
        assert table == {"_type": "trackio.table", "_value": table_rows(step)}
    assert trackio_config(project, mine["id"]) == CONFIG
    assert lines[0].startswith(f"trackio: started run seg ({mine['id']}) in project {project}, the local database")
    assert lines[1].startswith(f"trackio: continuing run seg ({mine['id']})") and len(lines) == 2, lines


def test_a_missing_tracker_package_is_a_start_up_error_naming_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # what an environment without trackio finds: nothing
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = Config()
    cfg.trainer.loggers = ["console", "trackio", "wandbb"]
    lines = config_problems(cfg, world_size=1, check_files=False)
    assert "trainer.loggers=['console', 'trackio', 'wandbb']: unknown sink(s) ['wandbb']; choose from " in lines[0]
    assert lines[1] == (
        "trainer.loggers=['console', 'trackio', 'wandbb']: trackio is not installed here: pip install trackio "
        '(or every tracker: pip install "rlspmd[trackers]")'
    )
    sft = SFTConfig(loggers=["jsonl", "mlflow"])
    assert sft_config_problems(sft, world_size=1, check_files=False) == [
        "loggers=['jsonl', 'mlflow']: mlflow is not installed here: pip install mlflow "
        '(or every tracker: pip install "rlspmd[trackers]")'
    ]


def test_offline_keeps_mlflow_and_trackio_on_this_machine(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("TRACKIO_SPACE_ID", raising=False)
    assert TrackerConfig(offline=True).problems() == []
    for uri in ("sqlite:////tmp/x.db", "file:///tmp/mlruns", "mlruns", "http://127.0.0.1:5000", "http://localhost:80"):
        assert TrackerConfig(offline=True, mlflow_tracking_uri=uri).problems() == [], uri
    assert TrackerConfig(offline=False, mlflow_tracking_uri="https://mlflow.example.com").problems() == []
    ((field, value, why),) = TrackerConfig(offline=True, mlflow_tracking_uri="https://mlflow.example.com").problems()
    assert field == "mlflow_tracking_uri" and value == "https://mlflow.example.com" and "offline=True" in why
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "databricks")
    monkeypatch.setenv("TRACKIO_SPACE_ID", "me/space")
    assert [(f, v) for f, v, _ in TrackerConfig(offline=True).problems()] == [
        ("mlflow_tracking_uri", "databricks"),
        ("trackio_space_id", "me/space"),
    ]
    cfg = Config()
    cfg.trainer.tracking = TrackerConfig(offline=True, project="", close_timeout_s=0)
    lines = config_problems(cfg, world_size=1, check_files=False)
    assert "trainer.tracking.project='': must not be empty" in lines
    assert "trainer.tracking.close_timeout_s=0: must be > 0" in lines
    assert any(line.startswith("trainer.tracking.trackio_space_id='me/space'") for line in lines)


def test_mlflow_params_are_the_config_flattened_with_names_mlflow_accepts():
    assert flat_params(CONFIG, limit=20) == {
        "actor.optim.lr": "1e-06",
        "actor.optim.betas": "[0.9, 0.999]",
        "actor.model.path": "models/tiny",
        "trainer.total_steps": "5",
        "trainer.loggers": '["jsonl", "wandb"...',  # cut at the limit (config.json keeps it whole)
        "seed": "null",
    }
    assert mlflow_name("val/acc/openai/gsm8k") == "val/acc/openai/gsm8k"
    assert mlflow_name("reward/component/my_fn(x)") == "reward/component/my_fn_x_"


def test_a_run_without_trackers_starts_and_logs_nothing(tmp_path):
    trackers = Trackers(["console", "jsonl", "tensorboard"], output_dir=str(tmp_path))
    trackers.start(write=pytest.fail)
    trackers.log(1, {"a": 1.0})
    trackers.table("samples/train", table_rows(1), 1)
    trackers.close()
    assert trackers.names == () and trackers.state_dict() == {"runs": {}} and list(tmp_path.iterdir()) == []
    assert trackers.component(is_main=True, saved=None) == {"trackers": trackers}
    assert trackers.component(is_main=False, saved=None) == {}
    assert trackers.component(is_main=True, saved=["sampler"]) == {}  # a checkpoint from before trackers had state
