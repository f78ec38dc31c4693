"""Bad input and failures through the real CLI on 2 ranks: every case ends every rank quickly with a non-zero
exit and a message that names the field, file, row, sample, parameter or step; nothing already saved is lost."""

from __future__ import annotations

import json
import os
import resource
import signal
import shutil
import time
from pathlib import Path

import pytest

from conftest import dist_script, load_script, torchrun
from rl_run import metrics, popen_torchrun, rl_args, run_torchrun, worker_pids, write_reward

pytestmark = pytest.mark.dist


def fails(target: list[str], *needles: str, nproc: int = 2, preexec_fn=None, within: float = 60) -> str:
    """Run, expect a non-zero exit and every needle in the output; returns the output. ``within``: the seconds the
    failure takes on a quiet machine; a job still running 60 s past it hangs and fails the test (a margin, not a
    timing assertion: CI's 2 cores run other tests' ranks too)."""
    proc = run_torchrun(target, nproc, preexec_fn=preexec_fn, timeout=within + 60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    for needle in needles:
        assert needle in out, f"{needle!r} not in output:\n{out[-4000:]}"
    return out


@pytest.fixture
def args(tiny_model, arithmetic_data, tmp_path):
    def make(*extra: str, model: Path = tiny_model, steps: int = 2) -> list[str]:
        return rl_args(model, arithmetic_data, tmp_path / "run", steps=steps, extra=list(extra))

    return make


# -- configuration ---------------------------------------------------------------------------------------


def test_missing_config_file(args, tmp_path):
    fails([*args(), "--config", str(tmp_path / "nope.py")], f"config file not found: {tmp_path / 'nope.py'}")


def test_typo_in_config_file_names_file_and_field(args, tmp_path):
    cfg = tmp_path / "bad_cfg.py"
    cfg.write_text(
        "from rlspmd.config import Config, TrainerConfig\nconfig = Config(trainer=TrainerConfig(totl_steps=3))\n"
    )
    fails([*args(), "--config", str(cfg)], f"config file {cfg} failed to load", "totl_steps")


def test_typo_in_command_line_field(args):
    out = fails([*args(), "--actor.optim.lrr", "1e-3"], "Unrecognized options", "--actor.optim.lrr")
    assert out.count("╭─ Unrecognized options") == 1, "only rank 0 reports a usage error"


@pytest.mark.parametrize(
    "extra, problems",
    [
        # The list, all at once: each of these used to crash 12-17 s in, after the model had loaded.
        (
            [
                "--data.train-batch-size",
                "0",
                "--rollout.n",
                "-1",
                "--actor.micro-batch-size",
                "0",
                "--reward.function",
                "/nonexistent/reward.py:score",
            ],
            [
                "data.train_batch_size=0: must be >= 1",
                "rollout.n=-1: must be >= 1",
                "actor.micro_batch_size=0: must be >= 1",
                "reward.function: file /nonexistent/reward.py does not exist",
            ],
        ),
        (
            ["--actor.mini-batch-size", "3", "--data.val-batch-size", "0"],
            ["actor.mini_batch_size=3: does not divide data.train_batch_size=4", "data.val_batch_size=0: must be >= 1"],
        ),
    ],
)
def test_bad_sizes_and_files_fail_before_anything_loads(args, extra, problems):
    """Every problem knowable from the config is reported at once, naming field and value, on every rank, before a
    model or dataset is read."""
    out = fails(
        [*args(), *extra], f"invalid configuration ({len(problems)} problem", "nothing was loaded", *problems, within=45
    )
    assert out.count(" failed:\n") == 1, (
        "one rank prints the report; the other exits on torchrun's SIGTERM or says it also failed"
    )
    assert "Traceback" not in out.split("[rlspmd]")[1], "a configuration error is reported without a traceback"
    assert "train prompts:" not in out and "backend gloo" not in out, "nothing may load before the check"


def test_reward_function_that_the_file_does_not_define(args, tmp_path):
    fn = write_reward(
        tmp_path,
        "import os\nos.system('touch ' + os.path.dirname(__file__) + '/imported')\n\n"
        "def other(r, g):\n    return 0.0\n",
    )
    fails(
        [*args(), "--reward.function", fn],
        f"reward.function='{fn}': {fn[: -len(':reward')]} has no function 'reward'",
        within=45,
    )
    assert not (tmp_path / "imported").exists(), "the check must not run the user's module"


def test_sft_batch_that_does_not_split_over_the_ranks(tiny_model, arithmetic_data, tmp_path):
    fails(
        [
            "-m",
            "rlspmd.sft",
            "--model.path",
            str(tiny_model),
            "--data.train-files",
            str(arithmetic_data / "sft.parquet"),
            "--data.batch-size",
            "3",
            "--output-dir",
            str(tmp_path),
        ],
        "data.batch_size=3: does not split over 2 DP ranks",
        within=45,
    )


def test_mesh_degree_that_does_not_divide_the_world(args):
    fails([*args(), "--mesh.rollout-tp", "3"], "mesh: rollout tensor-parallel degree 3 does not divide its 2 ranks")


def test_resume_none_refuses_a_directory_with_checkpoints(args, tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)
    for name in ("meta.json", ".metadata"):
        (tmp_path / "run" / "checkpoints" / "step_00000002" / name).write_text("{}")
    fails([*args(), "--resume", "none"], "checkpoint.resume=none", "already holds checkpoints (newest step_00000002)")


def test_resume_from_a_missing_checkpoint(args, tmp_path):
    fails(
        [*args(), "--resume", str(tmp_path / "nope")],
        f"checkpoint.resume: checkpoint {tmp_path / 'nope'} does not exist",
    )


# -- model ------------------------------------------------------------------------------------------------


def test_model_path_that_does_not_exist(args, tmp_path):
    fails(args(model=tmp_path / "no_model"), "actor.model.path", f"{tmp_path / 'no_model'} does not exist")


@pytest.mark.parametrize(
    "remove, message",
    [
        (("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"), "has no tokenizer files"),
        (("chat_template.jinja",), "has no chat template"),
    ],
)
def test_model_without_tokenizer_or_chat_template(args, tiny_model, tmp_path, remove, message):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    for name in remove:
        (model / name).unlink()
    fails(args(model=model), "actor.model.path: ", str(model), message)


# -- data -------------------------------------------------------------------------------------------------


def _write_parquet(path: Path, rows: dict) -> Path:
    import datasets

    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    return path


ROW = {
    "data_source": ["arithmetic"],
    "prompt": [[{"role": "user", "content": "Calculate 1 + 2."}]],
    "reward_model": [{"style": "rule", "ground_truth": "3"}],
}


@pytest.mark.parametrize("case", ["missing", "empty", "no_column"])
def test_bad_dataset(args, tmp_path, case):
    path = tmp_path / f"{case}.parquet"
    if case == "empty":
        import datasets

        datasets.Dataset.from_dict(ROW).select([]).to_parquet(str(path))
        message = "has no rows"
    elif case == "no_column":
        _write_parquet(path, {k: v for k, v in ROW.items() if k != "reward_model"})
        message = "lacks required column(s) ['reward_model']"
    else:
        message = "does not exist"
    fails([*args(), "--data.train-files", str(path)], "data.train_files: ", str(path), message)


def test_empty_prompt_names_the_file_and_row(args, tmp_path):
    rows = {k: v * 6 for k, v in ROW.items()}
    rows["prompt"] = [[{"role": "user", "content": "  " if i == 3 else f"Calculate {i} + 2."}] for i in range(6)]
    path = _write_parquet(tmp_path / "empty.parquet", rows)
    fails(
        [*args(), "--data.train-files", str(path)],
        f"data.train_files: {path} row 3: the prompt has no user message with text",
        "data.empty_prompts=drop",
    )


def test_jsonl_line_cut_in_half_names_the_line(args, tmp_path):
    import json as _json

    lines = [
        _json.dumps(
            {
                "data_source": "arithmetic",
                "prompt": [{"role": "user", "content": f"Calculate {i} + 1."}],
                "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            }
        )
        for i in range(6)
    ]
    lines[4] = lines[4][: len(lines[4]) // 2]
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join(lines) + "\n")
    fails([*args(), "--data.train-files", str(path)], f"data.train_files: cannot read {path} line 5: not valid JSON")


def test_truncated_weights_name_the_file(args, tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    fails(args(model=model), f"actor.model.path: {weights} is truncated or corrupt", within=45)


def test_overlong_prompt_names_the_row(args, arithmetic_data):
    fails(
        [*args(), "--data.overlong-prompts", "error", "--data.max-prompt-length", "8"],
        f"data.train_files: {arithmetic_data / 'train.parquet'} row 0: prompt has",
        "> data.max_prompt_length=8",
    )


def test_peer_failure_is_not_mistaken_for_a_stop_request():
    """SIGTERM normally means "checkpoint and stop at the next step"; not when torchrun sends it because a rank
    failed: then the survivors must exit at once (torchrun would otherwise wait 30 s before SIGKILL)."""
    t0 = time.monotonic()
    proc = run_torchrun([dist_script("stop_on_peer_failure_check.py")], 2)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "boom on rank 1" in out and "UNREACHABLE" not in out, out[-3000:]
    assert time.monotonic() - t0 < 20, "the surviving rank waited instead of exiting"


def test_peer_failure_sigterm_delivered_to_the_watcher_thread_ends_the_process(tmp_path):
    """The kernel may deliver torchrun's SIGTERM to any thread. When it lands on the signal-watcher thread, the main
    thread is not woken (here it even has SIGTERM blocked, which forces that delivery); the watcher alone must end
    the process when a peer has failed, from a thread where ``signal.signal`` is not allowed."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from conftest import ROOT, free_port

    port = str(free_port())
    code = (
        "import os, signal, sys, time\n"
        "from rlspmd.distributed.runtime import StopRequest, _failure_marker\n"
        "StopRequest().install()\n"
        "open(_failure_marker(), 'w').close()  # a peer of this job has failed\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # only the watcher thread can take it\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n"
        "print('UNREACHABLE', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": port}
    env.pop("TORCHELASTIC_RUN_ID", None)
    markers = Path(tempfile.gettempdir()).glob  # the child's marker: its run id (the port), this pid, its start time
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=25)
        assert proc.returncode != 0 and "UNREACHABLE" not in out, out
        assert time.monotonic() - t0 < 10, "the watcher thread did not end the process"
    finally:
        proc.kill()
        for marker in markers(f"rlspmd-failed-{port}-{os.getpid()}-*"):
            marker.unlink(missing_ok=True)


def test_a_stale_failure_marker_of_an_earlier_job_does_not_swallow_the_report():
    """A failure marker left under this job's name by an earlier job (from before this process started: same run id,
    an agent that had the same pid) is not a peer's failure: the first rank to fail still prints the whole report, and
    the next one its one line. (Before, every rank then printed only the one line, and the message was lost.)"""
    import os
    import subprocess
    import sys

    from conftest import ROOT, free_port

    code = (
        "import os, time\n"
        "from rlspmd.distributed.runtime import UserError, _failure_marker, report_failure\n"
        "m = _failure_marker()\n"
        "open(m, 'w').close()\n"
        "os.utime(m, (time.time() - 3600,) * 2)  # an earlier job's\n"
        "try:\n"
        "    report_failure(UserError('data.train_files: no such file'))\n"
        "    report_failure(UserError('data.train_files: no such file'))  # a second rank of this job\n"
        "finally:\n"
        "    os.remove(m)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": str(free_port())}
    env.pop("TORCHELASTIC_RUN_ID", None)
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stderr
    assert "[rlspmd] rank 0 failed:\ndata.train_files: no such file" in err, err
    assert "[rlspmd] rank 0 also failed: UserError: data.train_files: no such file" in err, err


# -- a launcher that dies, a rank that hangs ----------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_ranks_leave_when_torchrun_is_killed(tiny_model, arithmetic_data, tmp_path):
    """SIGKILL to torchrun's agent alone (the OOM killer, a lost login shell): its ranks live in sessions of their own,
    so nothing but rlspmd ends them. Every rank must be gone within seconds, having written no metric line and no
    checkpoint after the kill. (Reward workers die with their rank: ``test_rewards.py``.)"""
    out = tmp_path / "run"
    proc = popen_torchrun(
        rl_args(tiny_model, arithmetic_data, out, steps=200, extra=["--checkpoint.save-every", "1"]),
        2,
        log=tmp_path / "log",
    )
    log = lambda: (tmp_path / "log").read_text()[-3000:]  # noqa: E731
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "step_00000001").exists():
        assert proc.poll() is None and time.monotonic() < deadline, log()
        time.sleep(0.1)
    ranks = worker_pids(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(proc.pid, signal.SIGKILL)
    at_kill = (out / "metrics.jsonl").read_text(), sorted(p.name for p in (out / "checkpoints").iterdir())
    proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in ranks.values()):
        assert time.monotonic() < deadline, (
            f"ranks still running 20 s after the kill: {[p for p in ranks.values() if _alive(p)]}"
        )
        time.sleep(0.1)
    after = (out / "metrics.jsonl").read_text(), sorted(p.name for p in (out / "checkpoints").iterdir())
    assert after == at_kill, "a metric line or a checkpoint was written after torchrun was killed"
    for rank in ranks:
        assert f"[rlspmd] rank {rank}: the process that launched it (pid {proc.pid}" in log(), log()


@pytest.mark.slow
def test_a_rank_that_hangs_is_named_and_the_job_ends(args, tmp_path):
    """A reward function sleeps forever on rank 1 (in-process: no reward time limit). Rank 0 warns naming rank 1 and
    the reward stage, and past dist.hang_timeout_s every rank exits non-zero with that message."""
    fn = write_reward(
        tmp_path,
        "import os, time\n\ndef reward(response, ground_truth):\n"
        "    if os.environ['RANK'] == '1':\n        time.sleep(10**6)\n    return 0.0\n",
    )
    out = fails(
        [
            *args(),
            "--reward.function",
            fn,
            "--reward.timeout-s",
            "None",
            "--dist.hang-warn-s",
            "4",
            "--dist.hang-timeout-s",
            "20",
        ],
        "[rlspmd] hang monitor: rank 1 has been in stage 'reward'",
        "[rlspmd] hang: rank 1 has been in stage 'reward' of step 0 for 2",
        "longer than dist.hang_timeout_s=20; ending the job on every rank",
        "[rlspmd] rank 1: the hang monitor on rank 0 ended the job",
        within=90,
    )
    assert out.count("[rlspmd] hang monitor: rank 1 has been in stage 'reward'") >= 2, "the warning repeats"


# -- rewards ----------------------------------------------------------------------------------------------


def test_reward_function_raising_on_one_rank_ends_every_rank(args, tmp_path):
    fn = write_reward(
        tmp_path,
        "import os\n\ndef reward(response, ground_truth):\n"
        "    if os.environ['RANK'] == '1':\n        raise KeyError('no answer field')\n    return 0.0\n",
    )
    out = fails(
        [*args(), "--reward.function", fn],
        "reward function reward raised on sample index=",
        "data_source='arithmetic'",
        "KeyError: 'no answer field'",
    )
    assert out.count("[rlspmd] rank 1 failed:") == 1 and "[rlspmd] rank 0 failed:" not in out, out[-4000:]


def test_reward_function_returning_a_non_number(args, tmp_path):
    fn = write_reward(tmp_path, "def reward(response, ground_truth):\n    return 'yes'\n")
    fails(
        [*args(), "--reward.function", fn],
        "reward function reward returned 'yes' (not a finite number) on sample index=",
    )


# -- NaN / Inf --------------------------------------------------------------------------------------------

# A finite but absurdly scaled reward (no std normalisation): the policy-gradient loss and gradients overflow
# float32, a real way to get a non-finite loss and gradient norm.
HUGE_REWARD = "def reward(response, ground_truth):\n    return 3e38 if len(response) % 2 else 0.0\n"


@pytest.mark.slow
def test_non_finite_gradient_stop_names_the_step(args, tmp_path):
    fn = write_reward(tmp_path, HUGE_REWARD)
    fails(
        [
            *args(),
            "--reward.function",
            fn,
            "--algorithm.adv-estimator.norm-adv-by-std",
            "False",
            "--trainer.nan-policy",
            "stop",
        ],
        "FloatingPointError: step 1: non-finite loss or gradient norm",
        "trainer.nan_policy=stop",
    )


@pytest.mark.slow
def test_non_finite_gradient_skip_counts_and_keeps_weights(args, tmp_path, tiny_model):
    from safetensors.torch import load_file

    fn = write_reward(tmp_path, HUGE_REWARD)
    out = torchrun(
        [
            *args(),
            "--reward.function",
            fn,
            "--algorithm.adv-estimator.norm-adv-by-std",
            "False",
            "--checkpoint.save-hf",
        ],
        2,
    ).stdout
    assert "skipped" in out and "trainer.nan_policy=skip" in out
    rows = [m for m in metrics(tmp_path / "run") if m["step"] > 0]
    assert [m["actor/skipped_updates"] for m in rows] == [2.0, 2.0]  # both mini-batch updates of each step
    assert [m["trainer/skipped_updates_total"] for m in rows] == [2.0, 4.0]
    trained = load_file(tmp_path / "run" / "checkpoints" / "step_00000002" / "hf" / "model.safetensors")
    initial = load_file(tiny_model / "model.safetensors")
    assert all((trained[k] == initial[k]).all() for k in initial), "skipped updates must leave the weights alone"


# -- checkpoints ------------------------------------------------------------------------------------------


def test_checkpoint_dir_that_is_not_writable(args, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    fails(
        [*args(), "--checkpoint.dir", str(blocker / "ckpt")],
        f"checkpoint.dir={blocker / 'ckpt'} is not a writable directory",
    )


@pytest.fixture(scope="module")
def two_steps(tiny_model, arithmetic_data, tmp_path_factory) -> Path:
    """Checkpoints of a finished 2-step run (``<dir>/checkpoints/step_00000002``)."""
    out = tmp_path_factory.mktemp("two_steps")
    torchrun(rl_args(tiny_model, arithmetic_data, out, steps=2), 2)
    return out


def test_full_disk_during_save_keeps_the_previous_checkpoint(args, two_steps, tmp_path):
    """A run resumes from step 2's checkpoint; a file-size limit (RLIMIT_FSIZE, enforced by the kernel: writes
    fail with EFBIG as on a full disk) makes step 4's save fail. Step 2 stays intact and resumable."""
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(two_steps / "checkpoints", ckpts)
    before = sorted(p.name for p in (ckpts / "step_00000002").iterdir())

    def limit_file_size():  # checkpoint shards are MBs; metrics and logs stay far below
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    out = fails(
        args(steps=4),
        "saving step 4 failed",
        "the previous checkpoint step_00000002 is intact",
        preexec_fn=limit_file_size,
    )
    # The cause, in the words the failing write left: torch.save's zip writer may report a short write without errno.
    assert (
        "File too large" in out
        or "a write came up short: is the disk or quota full, or a file-size limit reached?" in out
    )
    assert f"checkpoint.dir (default <trainer.output_dir>/checkpoints)={ckpts}" in out
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # the failed .tmp is gone
    assert sorted(p.name for p in (ckpts / "step_00000002").iterdir()) == before
    assert json.loads((ckpts / "step_00000002" / "meta.json").read_text())["step"] == 2


def test_resume_with_an_incompatible_model(two_steps, arithmetic_data, tmp_path):
    ckpts = two_steps / "checkpoints"
    other = load_script("scripts/models/build_tiny.py").build(tmp_path / "wider", intermediate_size=256)
    fails(
        rl_args(other, arithmetic_data, tmp_path / "run2", steps=4, extra=["--resume", str(ckpts)]),
        f"checkpoint {ckpts / 'step_00000002'} was written for a different model",
        "parameter 'hf.model.layers.0.mlp.gate_proj.weight' has shape [352, 128] in the checkpoint but [256, 128]",
    )


def test_failure_markers_of_ended_jobs_are_swept_and_a_running_jobs_marker_is_kept(tmp_path, monkeypatch):
    """``sweep_failure_markers`` (rank 0 of each node at start): a failed job leaves its marker; the next job removes
    those whose torchrun agent (pid and start time in the name) no longer runs, and keeps a live agent's."""
    import subprocess
    import tempfile

    from rlspmd.distributed import runtime

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])  # a pid that has ended
    gone.wait()
    me, parent = os.getpid(), os.getppid()
    names = {
        "ended": f"rlspmd-failed-none-{gone.pid}-{runtime._start_time(me)}",
        "ended_with_dashes_in_run_id": f"rlspmd-failed-a-b-c-{gone.pid}-12345",
        "pid_reused": f"rlspmd-failed-none-{parent}-1",  # a live pid, but not the process the marker named
        "live": f"rlspmd-failed-none-{parent}-{runtime._start_time(parent)}",
        "unknown_start": f"rlspmd-failed-29500-{parent}-0",
        "not_a_marker": "rlspmd-failed-notes",
        "other_file": "unrelated-1-2",
    }
    for name in names.values():
        (tmp_path / name).touch()
    assert runtime.sweep_failure_markers() == 3
    left = {key for key, name in names.items() if (tmp_path / name).exists()}
    assert left == {"live", "unknown_start", "not_a_marker", "other_file"}
    assert runtime._failure_marker().startswith(str(tmp_path / "rlspmd-failed-"))
