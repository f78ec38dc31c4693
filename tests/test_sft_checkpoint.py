"""SFT checkpoints (2 ranks, Gloo, tiny model): stopping at a step and resuming gives the uninterrupted run's model,
optimiser, schedule, data order and losses, bit for bit; bad checkpoint settings are config errors."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from conftest import torchrun
from rl_run import assert_same_state, checkpoint_tensors, metrics

pytestmark = pytest.mark.dist


def sft_args(model, data, out, *extra: str) -> list[str]:
    return [
        "-m",
        "rlspmd.sft",
        "--config",
        "configs/sft_quickstart.py",
        "--model.path",
        str(model),
        "--data.train-files",
        str(data / "sft.parquet"),
        "--total-steps",
        "4",
        "--log-every",
        "1",
        "--checkpoint.save-every",
        "2",
        "--checkpoint.keep-last",
        "0",
        "--output-dir",
        str(out),
        "--loggers",
        "jsonl",
        *extra,
    ]


@pytest.mark.slow
def test_sft_stop_and_resume_is_bit_identical(tiny_model, arithmetic_data, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    torchrun(sft_args(tiny_model, arithmetic_data, whole, "--checkpoint.save-hf"), 2)
    first = torchrun(sft_args(tiny_model, arithmetic_data, split, "--stop-at-step", "3"), 2).stdout
    assert "stopped after step 3 on stop_at_step=3" in first
    assert not (split / "hf").exists()  # the export is the end of a run, not of a stop
    second = torchrun(sft_args(tiny_model, arithmetic_data, split, "--resume", "auto"), 2).stdout
    assert "resumed from" in second and "step_00000003 (step 3 of 4)" in second

    assert [m["step"] for m in metrics(split)] == [1, 2, 3, 4]  # continued, nothing repeated
    assert metrics(split) == metrics(whole)
    # model, optimiser, LR schedule, the sampler's place in the data order, RNGs
    assert_same_state(
        checkpoint_tensors(whole / "checkpoints" / "step_00000004"),
        checkpoint_tensors(split / "checkpoints" / "step_00000004"),
    )
    want, got = load_file(whole / "hf" / "model.safetensors"), load_file(split / "hf" / "model.safetensors")
    assert want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)
    # checkpoint.save_hf: the step's HF directory holds the model the run ends with
    saved = load_file(whole / "checkpoints" / "step_00000004" / "hf" / "model.safetensors")
    assert saved.keys() == want.keys() and all(saved[k].equal(want[k]) for k in want)


def test_sft_checkpoint_settings_are_checked_before_loading(tiny_model, arithmetic_data, tmp_path):
    out = torchrun(
        sft_args(
            tiny_model,
            arithmetic_data,
            tmp_path,
            "--stop-at-step",
            "9",
            "--checkpoint.keep-last",
            "-1",
            "--resume",
            str(tmp_path / "nowhere"),
        ),
        1,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    for field in ("stop_at_step", "checkpoint.keep_last", "checkpoint.resume"):
        assert field in text, text[-3000:]
    assert "nothing was loaded" in text
