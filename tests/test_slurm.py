"""The SLURM templates, as far as a machine without SLURM allows: syntax, the exact torchrun command for a fake
SLURM environment (RLSPMD_SLURM_DRY_RUN), and a real single-node run through the template with stand-ins for
srun/scontrol: time-limit SIGUSR1 -> checkpoint -> requeue -> the requeued job resumes and finishes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from rl_run import metrics, rl_args, write_reward

SLURM = ROOT / "scripts" / "slurm"
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then printf 'gpu-a17\\ngpu-a18\\ngpu-b02\\n'; exit 0; fi
echo "scontrol $*" >> "$FAKE_SLURM_LOG"
"""
# srun stand-in for one node: drop srun's own options (the templates pass them as single --opt=value words)
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""


@pytest.fixture
def fake_slurm(tmp_path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    config = tmp_path / "config.py"
    config.write_text("from rlspmd.config import Config\n\nconfig = Config()\n")
    return {
        **os.environ,
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "SLURM_JOB_ID": "73519",
        "SLURM_JOB_NODELIST": "gpu-a[17-18],gpu-b02",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_NNODES": "3",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "CONFIG": str(config),
    }


def dry_run(script: str, env: dict, *args: str) -> list[str]:
    proc = subprocess.run(
        ["bash", str(SLURM / script), env["CONFIG"], *args],
        env={**env, "RLSPMD_SLURM_DRY_RUN": "1"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


@pytest.mark.parametrize("script", ["single_node.sbatch", "multi_node.sbatch", "common.sh"])
def test_templates_parse(script):
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)


def test_multi_node_command_from_slurm_variables(fake_slurm):
    cmd = dry_run("multi_node.sbatch", fake_slurm, "--actor.optim.lr", "1e-6")
    assert cmd[:4] == ["srun", "--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    t = cmd.index("torchrun")
    assert cmd[t : t + 6] == [
        "torchrun",
        "--nnodes=3",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu-a17:33519",  # first host of the allocation, port 20000 + job id % 20000
        "--rdzv-id=73519-0",
    ]
    assert "--max-restarts=0" in cmd and "--shutdown-timeout=280" in cmd
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in cmd
    assert cmd[cmd.index("-m") :] == [
        "-m",
        "rlspmd.train",
        "--config",
        fake_slurm["CONFIG"],
        "--resume",
        "auto",
        "--actor.optim.lr",
        "1e-6",
    ]


def test_single_node_command_and_overrides(fake_slurm):
    env = {
        **fake_slurm,
        "SLURM_GPUS_ON_NODE": "h100:4",
        "SLURM_RESTART_COUNT": "2",
        "RLSPMD_OUTPUT_DIR": "/scratch/run 1",
        "RLSPMD_STOP_GRACE_S": "100",
    }
    cmd = dry_run("single_node.sbatch", env)
    assert cmd[: cmd.index("torchrun") + 5] == [
        "srun",
        "--ntasks=1",
        "--kill-on-bad-exit=1",
        "torchrun",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=4",
        "--max-restarts=0",
    ]
    assert "--shutdown-timeout=100" in cmd
    assert cmd[-2:] == ["--trainer.output-dir", "/scratch/run 1"]


def test_missing_config_is_a_usage_error(fake_slurm):
    proc = subprocess.run(
        ["bash", str(SLURM / "single_node.sbatch"), "nope.py"], env=fake_slurm, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "config file 'nope.py' not found" in proc.stderr


@pytest.mark.slow
@pytest.mark.dist
def test_time_limit_signal_checkpoints_requeues_and_resumes(fake_slurm, tiny_model, arithmetic_data, tmp_path):
    """SIGUSR1 to the batch shell (what --signal=B:USR1@300 does) -> srun -> torchrun -> workers save and stop;
    the script requeues the job; the requeued job (same command) resumes and finishes without a repeated step."""
    out = tmp_path / "run"
    overrides = rl_args(tiny_model, arithmetic_data, out, steps=8, reward=write_reward(tmp_path))[
        2:
    ]  # drop -m rlspmd.train
    env = {**fake_slurm, "RLSPMD_NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = ["bash", str(SLURM / "single_node.sbatch"), env["CONFIG"], *overrides]
    log = tmp_path / "job1.log"
    job = subprocess.Popen(
        cmd, env=env, cwd="/", stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or '"step": 1,' not in (out / "metrics.jsonl").read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = log.read_text()
    assert "asking the trainer to checkpoint and stop" in text and "stopped after step" in text, text[-3000:]
    assert (tmp_path / "slurm.log").read_text().strip() == "scontrol requeue 73519"
    stopped = metrics(out)[-1]["step"]
    assert stopped < 8

    second = subprocess.run(
        cmd, env={**env, "SLURM_RESTART_COUNT": "1"}, cwd="/", capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"step_{stopped:08d} at step {stopped}" in second.stdout
    assert [m["step"] for m in metrics(out)] == list(range(0, 9))
