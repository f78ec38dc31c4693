"""Single-process checks of the checkpoint bookkeeping: which checkpoint a resume picks, rewinding, pruning,
metrics.jsonl continuation, the ``--resume`` shorthand, the checkpoint section's checks, and the end of a step (save
when due, save and stop) that RL and SFT share."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

from rlspmd.config import CheckpointConfig, Config, SFTConfig
from rlspmd.distributed.runtime import StopRequest
from rlspmd.trainer.checkpoint import (
    Checkpointer,
    CheckpointStore,
    Counters,
    StopAndSave,
    complete_checkpoints,
    resolve_checkpoint,
)
from rlspmd.metrics import MetricLogger
from rlspmd.startup import parse_args
from rlspmd.validate import config_problems, sft_config_problems


def fake_checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    d = root / (f"step_{step:08d}" + ("" if complete else ".tmp"))
    d.mkdir(parents=True)
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": step}))
        (d / ".metadata").write_bytes(b"")
    return d


def checkpointer(root: Path, **kw) -> Checkpointer:
    return Checkpointer(CheckpointConfig(dir=str(root), **kw), output_dir="unused", rank=0, world_size=1)


def test_auto_picks_the_newest_complete_checkpoint(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 12, complete=False)  # an interrupted save
    (tmp_path / "step_00000011").mkdir()  # no meta.json: never committed
    assert checkpointer(tmp_path)._prepare() == tmp_path / "step_00000010"
    assert checkpointer(tmp_path / "empty")._prepare() is None  # nothing yet: a fresh start
    assert resolve_checkpoint(tmp_path, field_name="x") == tmp_path / "step_00000010"


def test_resume_none_refuses_existing_checkpoints(tmp_path):
    fake_checkpoint(tmp_path, 2)
    with pytest.raises(ValueError, match="checkpoint.resume=none.*already holds checkpoints"):
        checkpointer(tmp_path, resume="none")._prepare()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: fake_checkpoint(root, 4, complete=False), "interrupted save"),
        (lambda root: (root / "step_00000007").mkdir() or root / "step_00000007", "is incomplete"),
        (lambda root: (root / "elsewhere").mkdir() or root / "elsewhere", "holds no complete checkpoint"),
    ],
)
def test_resume_path_errors_name_the_path(tmp_path, make, message):
    target = make(tmp_path)
    with pytest.raises((FileNotFoundError, ValueError), match=message) as err:
        checkpointer(tmp_path / "ckpt", resume=str(target))._prepare()
    assert str(target) in str(err.value) and "checkpoint.resume" in str(err.value)


def test_rewinding_moves_newer_checkpoints_aside(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "latest").write_text("step_00000006\n")
    assert checkpointer(tmp_path, resume=str(tmp_path / "step_00000004"))._prepare() == tmp_path / "step_00000004"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    assert len(list(tmp_path.glob("step_00000006.superseded-*"))) == 1  # kept, but out of auto's and keep_last's way
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"


def test_prune_keeps_the_newest_and_removes_interrupted_saves(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 10, complete=False)
    checkpointer(tmp_path).dir.prune(keep=tmp_path / "step_00000008", keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000008"]


def test_a_file_where_the_directory_should_be(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        PermissionError, match=f"checkpoint.dir={tmp_path / 'file' / 'ckpt'} is not a writable directory"
    ):
        checkpointer(tmp_path / "file" / "ckpt")._prepare()


def test_metrics_jsonl_continues_after_resume(tmp_path):
    lines = [{"step": s, "x": s} for s in (0, 1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "x"')  # torn
    logger = MetricLogger(["jsonl"], str(tmp_path), total_steps=10, initial_step=2)
    logger.log(3, {"x": 30.0})
    logger.close()
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1, 2, 3] and kept[-1]["x"] == 30.0
    superseded = (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()
    assert len(superseded) == 3  # steps 3 and 4 of the crashed run, and its torn last line


def test_resume_shorthand_and_default():
    assert parse_args([])[0].checkpoint.resume == "auto"
    assert parse_args(["--resume", "none"])[0].checkpoint.resume == "none"
    assert parse_args(["--resume", "/ckpt/step_00000010"])[0].checkpoint.resume == "/ckpt/step_00000010"
    assert parse_args(["--checkpoint.resume", "none"])[0].checkpoint.resume == "none"


def test_the_checkpoint_numbers_are_checked_in_one_place(tmp_path):
    """The RL and SFT collectors report ``save_every`` and ``keep_last`` with every other problem; a ``Checkpointer``
    built without the collector (a tool, a test) refuses the same section with the same lines."""
    bad = CheckpointConfig(dir=str(tmp_path), save_every=-1, keep_last=-2)
    lines = ["checkpoint.save_every=-1: must be >= 0", "checkpoint.keep_last=-2: must be >= 0"]
    rl = config_problems(dataclasses.replace(Config(), checkpoint=bad), world_size=1, check_files=False)
    sft = sft_config_problems(dataclasses.replace(SFTConfig(), checkpoint=bad), world_size=1, check_files=False)
    assert [line for line in rl if line.startswith("checkpoint.")] == lines
    assert [line for line in sft if line.startswith("checkpoint.")] == lines
    with pytest.raises(ValueError) as err:
        Checkpointer(bad, output_dir="unused", rank=0, world_size=1)
    assert str(err.value) == "; ".join(lines)
    assert not [line for line in config_problems(Config(), world_size=1, check_files=False) if "checkpoint" in line]


class Saves:
    """The trainer side of the checkpoint, recording the steps it saved; when to save is a real ``Checkpointer``'s."""

    def __init__(self, cfg: CheckpointConfig):
        self.schedule = Checkpointer(cfg, output_dir="unused", rank=0, world_size=1)
        self.saved: list[int] = []

    def due(self, step: int, *, last: bool) -> bool:
        return self.schedule.due(step, last=last)

    def save(self, counters: Counters) -> Path:
        self.saved.append(counters.step)
        return Path(f"step_{counters.step:08d}")


class Lines:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.append(text)


def run_steps(total: int, *, stop_at: int = 0, signal_at: int = 0, **checkpoint) -> tuple[list[int], list[int], list]:
    """Steps 1..total as RL and SFT run them: (steps run, steps saved, log lines)."""
    saves, log, request = Saves(CheckpointConfig(**checkpoint)), Lines(), StopRequest()
    end = StopAndSave(
        saves,
        request,
        device=torch.device("cpu"),
        logger=log,
        total_steps=total,
        stop_at_step=stop_at,
        stop_field="stop_at_step",
        last=Path("resumed"),
    )
    ran = []
    for step in range(1, total + 1):
        ran.append(step)
        request.signal_name = "SIGUSR1" if step == signal_at else None  # as the handler records one
        if end(Counters(step=step)):
            break
    return ran, saves.saved, log.lines


def test_the_end_of_a_step_saves_when_due_and_on_a_stop():
    ran, saved, log = run_steps(10, stop_at=5, save_every=2, save_final=True)
    assert ran == [1, 2, 3, 4, 5] and saved == [2, 4, 5]
    assert log[-1] == "stopped after step 5 on stop_at_step=5; checkpoint step_00000005; continue with --resume auto"
    ran, saved, log = run_steps(10, signal_at=3, save_every=0, save_final=True)
    assert ran == [1, 2, 3] and saved == [3]
    assert log == [
        "step 3: saved checkpoint step_00000003",
        "stopped after step 3 on a stop signal (SIGTERM/SIGUSR1); checkpoint step_00000003; "
        "continue with --resume auto",
    ]
    assert run_steps(4, save_every=3, save_final=True)[:2] == ([1, 2, 3, 4], [3, 4])
    assert run_steps(4, save_every=0, save_final=False)[1:] == ([], [])


def test_a_stop_at_the_last_step_is_the_end_of_the_run():
    """Saved all the same, but no 'continue with --resume auto' (there is nothing to continue), and the caller's loop
    ends normally (SFT then writes its export)."""
    assert run_steps(4, stop_at=4, save_final=False) == ([1, 2, 3, 4], [4], ["step 4: saved checkpoint step_00000004"])
    assert run_steps(4, signal_at=4, save_final=False)[1:] == ([4], ["step 4: saved checkpoint step_00000004"])


def test_the_checkpointer_offers_the_store_contract():
    """``Checkpointer`` has every method of ``CheckpointStore`` with the same parameters (the contract the trainer side
    is written against; a store that drifts from it breaks a swap silently otherwise)."""
    methods = [n for n, v in vars(CheckpointStore).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert sorted(methods) == ["due", "load", "prepare", "save", "saved_tensors"]
    for name in methods:
        want = inspect.signature(getattr(CheckpointStore, name))
        got = inspect.signature(getattr(Checkpointer, name))
        assert [(p.name, p.kind) for p in got.parameters.values()] == [
            (p.name, p.kind) for p in want.parameters.values()
        ], name
