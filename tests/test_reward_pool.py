"""Reward functions under ``reward.timeout_s``: real worker processes, a call stuck in C code killed and replaced,
the timeout policy, the same scores and errors as in-process scoring, and workers that die with their rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlspmd.config import RewardConfig
from rlspmd.protocol import Batch
from rlspmd.rewards import RewardError, RewardManager

# Catastrophic backtracking: one call of the regex engine that runs for ages in C, holding the interpreter lock,
# so no signal handler (SIGALRM-style timeouts) can interrupt it; SIGTERM is ignored too. Only SIGKILL stops it.
STUCK = """import re, signal

def score(response, ground_truth):
    if ground_truth == "stuck":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        re.match(r"(a+)+$", "a" * 64 + "b")
    return float(len(response))
"""


class FakeTok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(int(t)) for t in row if t) for row in ids]


def batch(ground_truths: list[str], source: str = "custom") -> Batch:
    n = len(ground_truths)
    resp = torch.tensor([[5, 0], [7, 1], [9, 9], [3, 3]])[:n]
    return Batch(
        {"responses_BR": resp, "response_mask_BR": (resp > 0).long()},
        {
            "ground_truth": ground_truths,
            "data_source": [source] * n,
            "extra_info": [{"index": 10 + i} for i in range(n)],
        },
    )


@pytest.fixture
def stuck_fn(tmp_path) -> str:
    (tmp_path / "stuck.py").write_text(STUCK)
    return f"{tmp_path / 'stuck.py'}:score"


def manager(fn: str, **kw) -> RewardManager:
    return RewardManager(RewardConfig(function=fn, **kw), FakeTok())


def test_a_call_stuck_in_c_code_is_killed_and_scores_zero(stuck_fn, capfd):
    m = manager(stuck_fn, timeout_s=1.0, num_workers=1)
    first = m.pool.workers[0].proc
    out = m.score(batch(["a", "stuck", "b", "c"]))
    assert out["task_scores_B"].tolist() == [
        1.0,
        0.0,
        3.0,
        3.0,
    ]  # len("5"), killed, len("9 9"), len("3 3"): a new worker
    assert first.poll() == -signal.SIGKILL and m.pool.replaced == 1 and m.pool.workers[0].proc.poll() is None
    assert m.metrics() == {"reward/timeouts": 1.0} and m.metrics() == {"reward/timeouts": 0.0}
    err = capfd.readouterr().err
    assert (
        "reward function score ran past reward.timeout_s=1 on sample index=11 (batch position 1) (data_source='custom')"
        in err
    )
    assert "the sample scores 0 (reward.timeout_policy=zero)" in err
    assert m.score(batch(["a", "b"]))["task_scores_B"].tolist() == [1.0, 3.0]
    m.close()


def test_timeout_policy_error_names_the_sample(stuck_fn):
    m = manager(stuck_fn, timeout_s=1.0, num_workers=2, timeout_policy="error")
    with pytest.raises(
        RewardError,
        match=r"ran past reward.timeout_s=1 on sample index=12 \(batch position 2\) "
        r"\(data_source='custom'\); its worker was killed \(reward.timeout_policy=error\)",
    ):
        m.score(batch(["a", "b", "stuck", "c"]))
    m.close()


@pytest.mark.parametrize(
    "body, error",
    [
        (
            "def score(response, ground_truth, extra_info, data_source):\n"
            "    return len(response) + extra_info['index'] / 100 + (data_source == 'custom')\n",
            None,
        ),
        (
            "def score(response, ground_truth):\n    if ground_truth == 'b':\n        raise KeyError('boom')\n"
            "    return 1.0\n",
            r"reward function score raised on sample index=11 \(batch position 1\) "
            r"\(data_source='custom'\): KeyError: 'boom'",
        ),
        (
            "def score(response, ground_truth):\n    return float('nan')\n",
            r"reward function score returned nan \(not a finite number\) on sample index=10",
        ),
    ],
)
def test_workers_score_and_fail_exactly_like_this_process(tmp_path, body, error):
    (tmp_path / "fn.py").write_text(body)
    here, pooled = (
        manager(f"{tmp_path / 'fn.py'}:score", timeout_s=None),
        manager(f"{tmp_path / 'fn.py'}:score", num_workers=2),
    )
    assert here.pool is None and pooled.pool is not None
    if error is None:
        assert (
            pooled.score(batch(["a", "b", "c"]))["task_scores_B"].tolist()
            == here.score(batch(["a", "b", "c"]))["task_scores_B"].tolist()
        )
    else:
        for m in (here, pooled):
            with pytest.raises(RewardError, match=error):
                m.score(batch(["a", "b", "c"]))
    pooled.close()


def test_builtin_rules_stay_in_this_process():
    m = RewardManager(RewardConfig(), FakeTok())
    out = m.score(batch(["5", "7 1"], source="arithmetic"))
    assert out["task_scores_B"].tolist() == [0.0, 0.0] and m.pool is None  # no worker was started for regex rules


def test_workers_die_with_their_rank(tmp_path):
    """A rank that dies (SIGKILL, os._exit) takes its reward workers with it: parent-death signal + end of input."""
    (tmp_path / "fn.py").write_text("def score(response, ground_truth):\n    return 1.0\n")
    code = (
        "import time\n"
        "from rlspmd.rewards.pool import RewardPool\n"
        f"pool = RewardPool({str(tmp_path / 'fn.py') + ':score'!r}, num_workers=2, timeout_s=5.0)\n"
        "pool.map([('x', 'y', {}, 'custom')])\n"
        "print(' '.join(str(w.proc.pid) for w in pool.workers), flush=True)\n"
        "time.sleep(60)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ})
    workers = [int(p) for p in rank.stdout.readline().split()]
    assert len(workers) == 2
    rank.kill()
    rank.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers):
        assert time.monotonic() < deadline, "a reward worker outlived its rank"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False
