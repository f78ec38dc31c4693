"""The experiment trackers against MLflow's real tracking server (``mlflow server`` on 127.0.0.1, sqlite backend), and
all three under training: a 3-step GRPO run on 2 ranks with ``--trainer.loggers console jsonl wandb mlflow trackio``
(W&B offline, Trackio's local store), stopped after step 2 and resumed, must put the same values at the same steps in
every tracker as in metrics.jsonl, with the config and the samples table, in one run each; a server killed mid-run
costs one warning, not the run. Slow: the server takes ~25 s to start on 2 cores, the runs ~40 s each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from conftest import torchrun
from rl_run import popen_torchrun, rl_args, write_reward
from rlspmd.trackers import TrackerConfig, Trackers, flat_params
from rlspmd.utils.sample_text import read_samples
from rlspmd.trainer.samples import table_row
from test_trackers import CONFIG, finite, resumed, run_segment, step_metrics, table_rows
from tracker_read import (
    MlflowServer,
    mlflow_history,
    mlflow_runs,
    mlflow_table,
    trackio_config,
    trackio_logs,
    trackio_runs,
    wandb_runs,
    wandb_table,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow", reason="the trackers extra is not installed (scripts/install.sh installs it)")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    yield server
    server.kill()


def test_mlflow_gets_every_finite_metric_the_params_and_the_table_and_a_resume_continues_its_run(
    mlflow_server, tmp_path
):
    cfg, lines = TrackerConfig(project="unit-mlflow", mlflow_tracking_uri=mlflow_server.uri), []
    first = Trackers(["mlflow"], cfg, output_dir=str(tmp_path / "run_m"), config=CONFIG)
    run_segment(first, step_metrics(0, 3), lines=lines)
    changed = {**CONFIG, "trainer": {**CONFIG["trainer"], "total_steps": 6}}
    second = resumed(first, ["mlflow"], cfg, tmp_path / "run_m")
    second.config = changed  # the resume changed a setting
    run_segment(second, step_metrics(3, 5), lines=lines)

    client = mlflow_server.client()
    (run,) = mlflow_runs(client, "unit-mlflow")
    assert run.info.run_id == first.runs["mlflow"] == second.runs["mlflow"] and run.info.status == "FINISHED"
    assert run.info.run_name == "run_m"
    want: dict[str, list] = {}
    for step, m in step_metrics(0, 5).items():
        for k, v in finite(m).items():
            want.setdefault(k, []).append((step, v))
    assert mlflow_history(client, run.info.run_id, want) == want
    assert run.data.params == flat_params(CONFIG, limit=6000)  # the first values: params cannot change
    config_path = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    assert json.loads(open(config_path).read()) == changed  # rewritten at the resume
    assert mlflow_table(client, run, "samples/train") == [row for s in range(5) for row in table_rows(s)]
    assert lines[0] == f"mlflow: started run {run.info.run_id} (run_m) in experiment unit-mlflow at {mlflow_server.uri}"
    assert lines[1] == (
        "mlflow: params cannot change; the run keeps its first values of trainer.total_steps (its config.json "
        "artifact, rewritten, has the new ones)"
    )
    assert lines[2].startswith(f"mlflow: continuing run {run.info.run_id}") and len(lines) == 3


def test_a_tracker_that_fails_mid_run_is_reported_once_and_the_others_go_on(mlflow_server, tracker_stores, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run_f"
    cfg = TrackerConfig(project="unit-failing", offline=True, mlflow_tracking_uri=mlflow_server.uri)
    trackers, lines = Trackers(["wandb", "mlflow"], cfg, output_dir=str(out), config=CONFIG), []
    trackers.start(write=lines.append)
    metrics = step_metrics(0, 6)
    for step in (0, 1):
        trackers.log(step, metrics[step])
    client = mlflow_server.client()
    run_id = trackers.runs["mlflow"]
    deadline = time.monotonic() + 60
    while len(client.get_metric_history(run_id, "reward/mean")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    client.delete_run(run_id)  # MLflow refuses every later write to it
    for step in (2, 3, 4, 5):
        trackers.log(step, metrics[step])
        trackers.table("samples/train", table_rows(step), step)
    trackers.close()

    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: mlflow failed at step 2 (")
    assert warnings[0].endswith(
        "nothing more goes to mlflow in this run and training goes on (metrics.jsonl and samples/ have everything)"
    )
    (run,) = wandb_runs(out)
    assert {s: {k: v for k, v in row.items() if not k.startswith("samples/")} for s, row in run.history.items()} == {
        s: finite(m) for s, m in metrics.items()
    }


def approx_rows(rows: list[dict]) -> list[dict]:
    """MLflow's table artifact is pandas JSON, which keeps 10 significant digits of a float."""
    return [{k: pytest.approx(v, rel=1e-9) if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def jsonl_rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_logged_step(out) -> int:
    """The newest step in a running job's metrics.jsonl (-1: none yet; a line being written is skipped)."""
    path, last = out / "metrics.jsonl", -1
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            last = max(last, json.loads(line)["step"])
        except ValueError:
            pass
    return last


def values(row: dict) -> dict:
    """A metrics.jsonl row's metric values (``null`` for non-finite ones left out, as the trackers get none)."""
    return {k: v for k, v in row.items() if k not in ("step", "time") and v is not None}


def test_a_stopped_and_resumed_run_logs_the_jsonl_to_every_tracker_in_one_run_each(
    tiny_model, arithmetic_data, mlflow_server, tracker_stores, tmp_path
):
    for package in ("wandb", "trackio"):
        pytest.importorskip(package)
    out, project = tmp_path / "run", "e2e-trackers"
    args = rl_args(
        tiny_model,
        arithmetic_data,
        out,
        steps=3,
        reward=write_reward(tmp_path),
        extra=[
            *("--trainer.loggers", "console", "jsonl", "wandb", "mlflow", "trackio"),
            *("--trainer.tracking.offline", "--trainer.tracking.project", project),
            *("--trainer.tracking.mlflow-tracking-uri", mlflow_server.uri),
        ],
    )
    torchrun([*args, "--trainer.stop-at-step", "2"], 2)
    stopped = json.loads((out / "checkpoints/step_00000002/meta.json").read_text())
    proc = torchrun(args, 2)
    final = json.loads((out / "checkpoints/step_00000003/meta.json").read_text())
    runs = stopped["trainer_state"]["components"]["trackers"]["runs"]
    assert final["trainer_state"]["components"]["trackers"]["runs"] == runs and set(runs) == {
        "wandb",
        "mlflow",
        "trackio",
    }
    assert "warning" not in proc.stdout

    rows = jsonl_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    config = json.loads((out / "config.json").read_text())
    first_config = {**config, "trainer": {**config["trainer"], "stop_at_step": 2}}
    samples = {split: read_samples(out / "samples" / f"{split}.jsonl") for split in ("train", "val")}

    def table(split: str, step: int) -> list[dict]:
        return [table_row(rec) for rec in samples[split] if rec["step"] == step]

    assert [len(table("train", s)) for s in (1, 2, 3)] == [4, 4, 4] and len(table("val", 0)) == 8

    # W&B: one run (rank 0 only), written in two offline segments with the same id
    first, second = wandb_runs(out)
    assert first.run_id == second.run_id == runs["wandb"] and (first.project, first.name) == (project, "run")
    assert first.config == first_config and second.config == config
    history = {**first.history, **second.history}
    assert sorted(first.history) == [0, 1, 2] and sorted(second.history) == [3]
    for row in rows:
        assert {k: v for k, v in history[row["step"]].items() if not k.startswith("samples/")} == values(row)
    for run, split, step in [(first, "val", 0), (first, "train", 1), (first, "train", 2), (first, "val", 2)]:
        assert wandb_table(run, step, f"samples/{split}") == table(split, step)
    assert wandb_table(second, 3, "samples/train") == table("train", 3)
    assert wandb_table(second, 3, "samples/val") == table("val", 3)

    # MLflow: one run, every metric's history the jsonl's, the first segment's params, the tables appended
    client = mlflow_server.client()
    (run,) = mlflow_runs(client, project)
    assert run.info.run_id == runs["mlflow"] and run.info.status == "FINISHED" and run.info.run_name == "run"
    want: dict[str, list] = {}
    for row in rows:
        for k, v in values(row).items():
            want.setdefault(k, []).append((row["step"], v))
    assert mlflow_history(client, run.info.run_id, want) == want
    assert run.data.params == flat_params(first_config, limit=6000)
    for split, steps in (("train", (1, 2, 3)), ("val", (0, 2, 3))):
        assert mlflow_table(client, run, f"samples/{split}") == approx_rows([r for s in steps for r in table(split, s)])

    # Trackio: one run, every metric and table at its step
    (record,) = trackio_runs(project)
    assert record["id"] == runs["trackio"]["id"] and record["name"] == runs["trackio"]["name"] == "run"
    logs = trackio_logs(project, record["id"])
    assert sorted(logs) == [0, 1, 2, 3]
    for row in rows:
        got = logs[row["step"]]
        tables = {k: got.pop(k) for k in list(got) if k.startswith("samples/")}
        assert got == values(row)
        assert tables == {
            f"samples/{split}": {"_type": "trackio.table", "_value": table(split, row["step"])}
            for split in ("train", "val")
            if table(split, row["step"])
        }
    assert trackio_config(project, record["id"]) in (config, first_config)


def test_killing_the_mlflow_server_mid_run_costs_one_warning_and_training_goes_on(
    tiny_model, arithmetic_data, tmp_path
):
    pytest.importorskip("mlflow")
    server = MlflowServer(tmp_path / "mlflow")
    out, log = tmp_path / "run", tmp_path / "train.log"
    args = rl_args(
        tiny_model,
        arithmetic_data,
        out,
        steps=8,
        extra=[
            *("--trainer.loggers", "console", "jsonl", "mlflow", "--trainer.val-every", "0"),
            *("--trainer.tracking.project", "killed", "--trainer.tracking.mlflow-tracking-uri", server.uri),
        ],
    )
    # MLflow retries a refused connection for ~4 minutes by default; the tracker's thread would wait that long
    proc = popen_torchrun(args, 2, env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}, log=log)
    try:
        deadline = time.monotonic() + 300
        while last_logged_step(out) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        killed_after = last_logged_step(out)
        server.kill()
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        server.kill()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert killed_after < 8 and [r["step"] for r in jsonl_rows(out)] == list(range(9))
    warnings = [line for line in re.split(r"[\r\n]", text) if "warning" in line.lower() and "mlflow" in line]
    assert len(warnings) == 1, warnings
    # the step whose record the thread was sending when the server went (it may lag the training loop)
    failed_at = int(re.search(r"warning: mlflow failed at step (\d+) \(", warnings[0]).group(1))
    assert 0 <= failed_at <= 8 and "training goes on" in warnings[0]


def test_sft_sends_its_metrics_and_config_to_the_trackers(tiny_model, arithmetic_data, tracker_stores, tmp_path):
    pytest.importorskip("trackio")
    out, project = tmp_path / "sft", "e2e-sft"
    torchrun(
        [
            *("-m", "rlspmd.sft", "--config", "configs/sft_quickstart.py", "--model.path", str(tiny_model)),
            *("--data.train-files", str(arithmetic_data / "sft.parquet"), "--data.batch-size", "8"),
            *("--micro-batch-size", "4", "--total-steps", "4", "--log-every", "2", "--output-dir", str(out)),
            *("--loggers", "jsonl", "trackio", "--tracking.project", project, "--tracking.offline"),
        ],
        2,
    )
    rows = jsonl_rows(out)
    assert [r["step"] for r in rows] == [2, 4]
    (record,) = trackio_runs(project)
    assert trackio_logs(project, record["id"]) == {r["step"]: values(r) for r in rows}
    config = trackio_config(project, record["id"])
    assert (
        config["total_steps"] == 4
        and config["model"]["path"] == str(tiny_model)
        and config["loggers"]
        == [
            "jsonl",
            "trackio",
        ]
    )
