"""Checkpoints end to end (2 ranks, Gloo, tiny model): exact resume, SIGKILL mid-save, stop signals,
resharding 2 -> 1 ranks, Hugging Face export that reproduces the trained model's log-probs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, dist_script, torchrun
from rl_run import assert_same_state, checkpoint_tensors, metrics, popen_torchrun, rl_args, worker_pids, write_reward

pytestmark = pytest.mark.dist
HOOKS = Path(__file__).resolve().parent / "hooks"


@pytest.fixture(scope="module")
def reward_fn(tmp_path_factory) -> str:
    return write_reward(tmp_path_factory.mktemp("reward"))


@pytest.fixture(scope="module")
def reference_run(tiny_model, arithmetic_data, reward_fn, tmp_path_factory) -> Path:
    """4 uninterrupted steps, checkpoints at steps 2 and 4 (the 4th also as an HF directory)."""
    out = tmp_path_factory.mktemp("reference")
    torchrun(rl_args(tiny_model, arithmetic_data, out, reward=reward_fn, extra=["--checkpoint.save-hf"]), 2)
    return out


@pytest.mark.slow
def test_stop_and_resume_is_bit_identical(reference_run, tiny_model, arithmetic_data, reward_fn, tmp_path):
    """2N steps == N steps, stop, resume for N more: same weights, optimiser, scheduler, sampler, RNG, metrics."""
    args = rl_args(tiny_model, arithmetic_data, tmp_path, reward=reward_fn)
    first = torchrun([*args, "--trainer.stop-at-step", "2"], 2).stdout
    assert "stopped after step 2" in first
    assert not (tmp_path / "checkpoints" / "step_00000004").exists()
    second = torchrun([*args, "--resume", "auto"], 2).stdout
    assert "resumed from" in second and "step_00000002 at step 2" in second

    ref_metrics, got = metrics(reference_run), metrics(tmp_path)
    assert [m["step"] for m in got] == [0, 1, 2, 3, 4]  # continued, nothing duplicated
    assert got == ref_metrics
    ref = checkpoint_tensors(reference_run / "checkpoints" / "step_00000004")
    assert_same_state(ref, checkpoint_tensors(tmp_path / "checkpoints" / "step_00000004"))
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"


@pytest.mark.slow
def test_sigkill_mid_save_resumes_from_previous_complete_checkpoint(
    reference_run, tiny_model, arithmetic_data, reward_fn, tmp_path
):
    args = rl_args(tiny_model, arithmetic_data, tmp_path, reward=reward_fn)
    env = {
        "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ["PYTHONPATH"]]),
        "RLSPMD_TEST_SLOW_SAVE": "step_00000004.tmp:60",
    }
    proc = popen_torchrun(args, 2, env=env, log=tmp_path / "killed.log")
    ckpts = tmp_path / "checkpoints"
    tmp_dir = ckpts / "step_00000004.tmp"
    deadline = time.monotonic() + 240
    # every rank has written its shard; rank 0 is about to write .metadata and rename: kill the job now
    while not (tmp_dir / "__0_0.distcp").exists() or not (tmp_dir / "__1_0.distcp").exists():
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the step-4 save never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert not (ckpts / "step_00000004").exists()

    out = torchrun([*args, "--resume", "auto"], 2).stdout
    assert "step_00000002 at step 2" in out
    assert not list(ckpts.glob("*.tmp")), "the interrupted save should be cleaned up by the next save"
    got = metrics(tmp_path)
    assert [m["step"] for m in got] == [0, 1, 2, 3, 4]
    assert got == metrics(reference_run)
    assert_same_state(
        checkpoint_tensors(reference_run / "checkpoints" / "step_00000004"), checkpoint_tensors(ckpts / "step_00000004")
    )


@pytest.mark.slow
def test_stop_signals_save_and_exit(tiny_model, arithmetic_data, reward_fn, tmp_path):
    """SIGUSR1 on one rank stops every rank after a checkpoint; SIGTERM to torchrun (SLURM preemption) too."""
    for sig, target in [(signal.SIGUSR1, "rank1"), (signal.SIGTERM, "agent")]:
        out = tmp_path / sig.name
        proc = popen_torchrun(
            rl_args(tiny_model, arithmetic_data, out, steps=50, reward=reward_fn), 2, log=tmp_path / f"{sig.name}.log"
        )
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or '"step": 1' not in (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{sig.name}.log").read_text()[
                -3000:
            ]
            time.sleep(0.1)
        os.kill(worker_pids(proc.pid)[1] if target == "rank1" else proc.pid, sig)
        rc = proc.wait(timeout=120)
        log = (tmp_path / f"{sig.name}.log").read_text()
        stopped = [m["step"] for m in metrics(out)][-1]
        assert 1 <= stopped < 50, log[-3000:]
        assert f"stopped after step {stopped} on a stop signal" in log, log[-3000:]
        assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
        if target == "rank1":
            assert rc == 0, log[-3000:]  # a clean stop; torchrun itself exits non-zero when it was signalled


@pytest.mark.slow
def test_resume_on_a_different_number_of_ranks(reference_run, tiny_model, arithmetic_data, reward_fn, tmp_path):
    """A 2-rank checkpoint restores bit-exactly onto 1 rank (DCP reshards), and training continues there."""
    ckpt = reference_run / "checkpoints" / "step_00000002"
    full = checkpoint_tensors(ckpt)
    restored = tmp_path / "restored_1rank.pt"
    torchrun([dist_script("checkpoint_load_check.py"), str(tiny_model), str(ckpt), str(restored)], 1)
    got = torch.load(restored, weights_only=False)
    for name, value in got["model"].items():
        assert torch.equal(value, full[f"actor.model.{name}"]), name
    for name, state in got["optim"]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, full[f"actor.optim.state.{name}.{k}"]), (name, k)

    out = torchrun(
        rl_args(tiny_model, arithmetic_data, tmp_path / "run", reward=reward_fn, extra=["--resume", str(ckpt)]), 1
    ).stdout
    assert "written by 2 ranks; resharded onto 1" in out
    assert [m["step"] for m in metrics(tmp_path / "run")] == [3, 4]
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "meta.json").is_file()


def test_export_hf_reproduces_the_trained_log_probs(reference_run, tiny_model, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = reference_run / "checkpoints" / "step_00000004"
    trained = tmp_path / "trained.pt"
    torchrun([dist_script("checkpoint_load_check.py"), str(tiny_model), str(ckpt), str(trained)], 2)
    trained = torch.load(trained, weights_only=False)

    out = tmp_path / "hf"
    subprocess.run(
        [sys.executable, "scripts/export_hf.py", str(reference_run / "checkpoints"), str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    exported = load_file(out / "model.safetensors")
    at_save = load_file(ckpt / "hf" / "model.safetensors")  # checkpoint.save_hf
    initial = load_file(tiny_model / "model.safetensors")
    assert exported.keys() == at_save.keys()
    assert all(torch.equal(exported[k], at_save[k]) for k in exported)
    assert all(not torch.equal(exported[k], initial[k]) for k in initial), "training should have changed every weight"

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    b = trained["batch"]
    R = b["responses_BR"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids_BL"], attention_mask=b["attention_mask_BL"], position_ids=b["position_ids_BL"]
        ).logits
    logprobs = (
        torch.log_softmax(logits[:, -R - 1 : -1].float(), -1).gather(-1, b["responses_BR"][..., None]).squeeze(-1)
    )
    mask = b["response_mask_BR"].bool()
    torch.testing.assert_close(logprobs[mask], trained["logprobs"][mask], rtol=1e-4, atol=1e-4)
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name


def test_export_hf_names_a_bad_checkpoint(tmp_path):
    """(The other bad paths are covered by ``resolve_checkpoint``'s unit tests.)"""
    target = tmp_path / "step_00000003.tmp"
    target.mkdir()
    proc = subprocess.run(
        [sys.executable, "scripts/export_hf.py", str(target), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and f"export_hf: checkpoint: {target} is an interrupted save" in proc.stderr, (
        proc.stderr
    )


def test_meta_records_what_export_needs(reference_run):
    ckpt = reference_run / "checkpoints" / "step_00000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["step"] == 4 and meta["world_size"] == 2 and meta["roles"] == ["actor"]
    assert (
        meta["trainer_components"] == ["sampler", "trackers"]
        and meta["trainer_state"]["components"]["sampler"]["position"] == 16
        and meta["trainer_state"]["components"]["trackers"] == {"runs": {}}  # no tracker in trainer.loggers
    )
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in (ckpt / "model").iterdir()}
    # keep_last=3 by default: both checkpoints of this 2-checkpoint run remain
    assert sorted(p.name for p in (reference_run / "checkpoints").iterdir()) == [
        "latest",
        "step_00000002",
        "step_00000004",
    ]
