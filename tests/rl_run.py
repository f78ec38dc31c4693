"""Helpers for end-to-end RL runs under torchrun in tests: a small fast config, metrics and checkpoint readers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from conftest import ROOT, free_port

# A reward that depends on the sampled text, so advantages (and gradients) are non-zero even for a random model.
LENGTH_REWARD = "def reward(response, ground_truth):\n    return (len(response) % 7) / 7.0\n"
VOLATILE = ("time", "timing/", "throughput/")  # wall-clock metrics: never reproducible


def write_reward(tmp_path: Path, body: str = LENGTH_REWARD, name: str = "reward_fn.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return f"{path}:reward"


def rl_args(
    model: Path, data: Path, out: Path, *, steps: int = 4, reward: str | None = None, extra: list[str] = ()
) -> list[str]:
    """A 2-rank-friendly GRPO run on the tiny model: 4 prompts x 2 samples per step, 16-token responses."""
    return [
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
        "--data.max-val-samples",
        "8",
        "--actor.mini-batch-size",
        "2",
        "--actor.micro-batch-size",
        "4",
        "--actor.optim.lr",
        "1e-3",
        "--rollout.n",
        "2",
        "--rollout.max-response-length",
        "16",
        "--trainer.total-steps",
        str(steps),
        "--trainer.val-every",
        "2",
        "--trainer.output-dir",
        str(out),
        "--trainer.loggers",
        "jsonl",
        "--trainer.deterministic",
        "--checkpoint.save-every",
        "2",
        *(["--reward.function", reward] if reward else []),
        *extra,
    ]


def metrics(out: Path) -> list[dict]:
    """metrics.jsonl without wall-clock fields."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


# Tolerance for values recorded on another machine (tests/data/*.json): its float kernels round differently in the
# last bits (seen: up to ~4e-5 relative, ~2e-7 absolute on a near-cancelling policy loss), while a one-line change to
# the algorithm moves losses and gradient norms by 1e-3 relative or more (tests/test_loss_parity.py's docstring).
RECORDED_REL, RECORDED_ABS = 2e-4, 1e-6


def assert_close_to_recording(got: list[dict], want: list[dict], *, what: str) -> None:
    """Step by step, every recorded metric present and within the tolerance above (metrics added since the recording
    are not compared)."""
    import pytest

    assert len(got) == len(want), f"{what}: {len(got)} steps, recorded {len(want)}"
    for step, (g, w) in enumerate(zip(got, want), 1):
        assert set(w) <= set(g), f"{what} step {step}: recorded metrics {sorted(set(w) - set(g))} missing"
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=RECORDED_REL, abs=RECORDED_ABS), (
                f"{what} step {step} {k}: {g[k]} != recorded {w[k]}"
            )


def checkpoint_tensors(ckpt: Path) -> dict[str, object]:
    """Every value of a DCP checkpoint, unsharded, by flat key (model, optimiser, scheduler, trainer, RNG), read the
    way a resume reads it (no code runs); the trainer's JSON string is decoded so that key order cannot matter."""
    from rlspmd.trainer.checkpoint import read_checkpoint

    flat = read_checkpoint(ckpt)
    if isinstance(flat.get("trainer.json"), str):
        flat["trainer.json"] = json.loads(flat["trainer.json"])
    return flat


def same(x, y) -> bool:
    """Exact equality through tensors, arrays and containers."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and np.array_equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


def assert_same_state(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    differ = [k for k in a if not same(a[k], b[k])]
    assert not differ, f"{len(differ)} checkpoint entries differ, e.g. {differ[:5]}"


def run_torchrun(
    target: list[str], nproc: int, *, timeout: float = 120, preexec_fn=None
) -> subprocess.CompletedProcess:
    """Like ``conftest.torchrun`` without the check, and with a ``preexec_fn`` (e.g. resource limits)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *target,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn
    )


def popen_torchrun(target: list[str], nproc: int, *, env: dict | None = None, log: Path) -> subprocess.Popen:
    """Start torchrun in its own session (so a test can kill the whole job), output to ``log``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *target,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def worker_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (children of the agent)."""
    out = {}
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"RANK="):
                    out[int(item[5:])] = int(pid)
    return out
