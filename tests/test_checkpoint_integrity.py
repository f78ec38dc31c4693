"""Checkpoint integrity: the digest of every DCP file is taken as it is written, recorded in ``meta.json``, and checked
before a load; a changed byte is named by file, and ``--resume auto`` falls back to the newest intact checkpoint."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from conftest import torchrun
from rl_run import metrics, rl_args, write_reward
from rlspmd.config import CheckpointConfig
from rlspmd.trainer.checkpoint import (
    DIGEST,
    CheckpointDamagedError,
    CheckpointError,
    Checkpointer,
    DigestingFileSystemWriter,
    FileDigests,
    dcp_load,
    read_dcp_metadata,
    share_files,
    verify_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"actor": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g), "lr": 0.25, "n": seed}}


def flip_byte_in_tensor(ckpt: Path, key: str = "actor.w", file: str = "__0_0.distcp") -> tuple[Path, int]:
    """Flip one byte in the middle of ``key``'s bytes in ``file`` (in its tensor data, not in a zip header), as a flaky
    file system or a bad copy would: returns the file and the offset."""
    md = read_dcp_metadata(ckpt)
    info = next(v for k, v in md.storage_data.items() if k.fqn == key and v.relative_path == file)
    path, at = ckpt / info.relative_path, info.offset + info.length // 2
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return path, at


def test_digests_are_those_of_the_bytes_on_disk(tmp_path):
    digests = FileDigests(tmp_path / "c")
    dcp.save(state(0), storage_writer=DigestingFileSystemWriter(tmp_path / "c", digests), no_dist=True)
    on_disk = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    assert set(on_disk) == {".metadata", "__0_0.distcp"}  # .metadata.tmp was renamed, and the record followed it
    assert digests.files == {
        name: {"size": len(b), "digest": hashlib.sha256(b).hexdigest()} for name, b in on_disk.items()
    }
    assert DIGEST == "sha256"


def test_digesting_stream_refuses_to_seek(tmp_path):
    from rlspmd.trainer.checkpoint import DigestingFileSystem

    fs = DigestingFileSystem(FileDigests(tmp_path))
    with pytest.raises(OSError, match="written front to back"), fs.create_stream(tmp_path / "f", "wb") as f:
        f.write(b"abc")
        f.seek(0)
    assert fs.digests.files == {}, "a failed write records nothing"


def test_files_are_shared_out_by_size():
    files = {n: {"size": s, "digest": ""} for n, s in {"a": 10, "b": 7, "c": 5, "d": 3, ".metadata": 1}.items()}
    assert share_files(files, 2) == [["a", "d"], ["b", "c", ".metadata"]]
    assert share_files(files, 1) == [["a", "b", "c", "d", ".metadata"]]
    assert share_files(files, 7)[5:] == [[], []]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def saver(root: Path, **kw) -> Checkpointer:
    return Checkpointer(CheckpointConfig(dir=str(root), **kw), output_dir="unused", rank=0, world_size=1)


def save(root: Path, step: int) -> Path:
    return saver(root).save(step, state(step), meta={"trainer_components": []}, write_files=lambda d: None)


def test_a_flipped_byte_is_named_by_file(world_of_one, tmp_path):
    ckpt = save(tmp_path, 2)
    recorded = json.loads((ckpt / "meta.json").read_text())["digests"]
    assert recorded["algorithm"] == "sha256" and set(recorded["files"]) == {".metadata", "__0_0.distcp"}
    assert verify_checkpoint(ckpt) is True
    shard, _ = flip_byte_in_tensor(ckpt)

    # Without the record the change goes unnoticed: DCP loads the changed value.
    silently = {"actor": {"w": torch.zeros(256, 64)}}
    dcp_load(silently, ckpt, no_dist=True)
    assert (silently["actor"]["w"] != state(2)["actor"]["w"]).sum() == 1

    expected = recorded["files"]["__0_0.distcp"]["digest"]
    found = hashlib.sha256(shard.read_bytes()).hexdigest()
    message = f"{shard} does not match its recorded sha256: expected {expected}, found {found}"
    with pytest.raises(CheckpointDamagedError) as err:
        verify_checkpoint(ckpt)
    assert message in str(err.value) and err.value.problems == [message]
    target = {"actor": {"w": torch.zeros(256, 64), "b": torch.zeros(64), "lr": None, "n": None}}
    with pytest.raises(CheckpointDamagedError, match=re.escape(message)):  # the trainer's load checks before reading
        saver(tmp_path).load(ckpt, target, engines={}, components=[])
    assert not target["actor"]["w"].any(), "nothing may be loaded from a damaged checkpoint"


def test_truncated_and_missing_files_are_named(world_of_one, tmp_path):
    ckpt = save(tmp_path, 2)
    meta = ckpt / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-1])
    (ckpt / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointDamagedError) as err:
        verify_checkpoint(ckpt)
    assert err.value.problems[0].startswith(f"{meta} has ") and "truncated or appended to" in err.value.problems[0]
    assert err.value.problems[1].startswith(f"{ckpt / '__0_0.distcp'} cannot be read (FileNotFoundError")


def test_resume_auto_falls_back_to_the_newest_intact_checkpoint(world_of_one, tmp_path, capsys):
    for step in (2, 4, 6):
        save(tmp_path, step)
    flip_byte_in_tensor(tmp_path / "step_00000006")
    flip_byte_in_tensor(tmp_path / "step_00000004", key="actor.b")
    loader = saver(tmp_path)
    assert loader.prepare() == tmp_path / "step_00000002"
    out = capsys.readouterr().out
    for step in (4, 6):
        assert re.search(
            rf"rank 0: checkpoint.resume=auto: checkpoint {tmp_path}/step_0000000{step} is damaged: "
            rf"{tmp_path}/step_0000000{step}/__0_0.distcp does not match its recorded sha256: expected \w+, "
            rf"found \w+; resuming from the newest intact checkpoint step_00000002 instead \(moved "
            rf"step_0000000{step} aside to step_0000000{step}.damaged-",
            out,
        ), out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:2] == ["latest", "step_00000002"] and [n.split(".")[0] for n in names[2:]] == [
        "step_00000004",
        "step_00000006",
    ]
    assert all(".damaged-" in n for n in names[2:])
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    target = {"actor": {"w": torch.zeros(256, 64), "b": torch.zeros(64), "lr": None, "n": None}}
    loader.load(tmp_path / "step_00000002", target, engines={}, components=[])
    assert torch.equal(target["actor"]["w"], state(2)["actor"]["w"]) and target["actor"]["n"] == 2


def test_a_damaged_checkpoint_named_explicitly_is_an_error(world_of_one, tmp_path):
    for step in (2, 4, 6):
        save(tmp_path, step)
    shard, _ = flip_byte_in_tensor(tmp_path / "step_00000004")
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"{shard} does not match its recorded sha256")):
        saver(tmp_path, resume=str(tmp_path / "step_00000004")).prepare()
    # nothing was moved: not the damaged checkpoint, not the newer one a rewind would have set aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000004", "step_00000006"]


def test_when_every_checkpoint_is_damaged_auto_stops(world_of_one, tmp_path):
    for step in (2, 4):
        save(tmp_path, step)
        flip_byte_in_tensor(tmp_path / f"step_0000000{step}")
    (tmp_path / "step_00000004" / "meta.json").write_text("{not json")  # a damaged record counts as damage too
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged") as err:
        saver(tmp_path).prepare()
    assert "step_00000004: cannot read meta.json" in str(
        err.value
    ) and "step_00000002/__0_0.distcp does not match" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def test_a_checkpoint_without_digests_still_loads(world_of_one, tmp_path, capsys):
    """Written before digests were recorded: meta.json has no ``digests``;
    it is resumed, unchecked, and rank 0 says so."""
    ckpt = save(tmp_path, 2)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["digests"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    loader = saver(tmp_path)
    assert loader.prepare() == ckpt
    assert f"checkpoint {ckpt} records no file digests (written before rlspmd recorded them)" in capsys.readouterr().out
    target = {"actor": {"w": torch.zeros(256, 64), "b": torch.zeros(64), "lr": None, "n": None}}
    loader.load(ckpt, target, engines={}, components=[])
    assert torch.equal(target["actor"]["w"], state(2)["actor"]["w"]) and target["actor"]["lr"] == 0.25
    assert verify_checkpoint(ckpt) is False


@pytest.mark.slow
@pytest.mark.dist
def test_resume_auto_names_the_damaged_file_and_continues_from_the_previous_checkpoint(
    tiny_model, arithmetic_data, tmp_path
):
    """2 ranks: a 4-step run saves steps 2 and 4; one byte of rank 1's shard of step 4 is flipped. ``--resume auto``
    names the file on both ranks, resumes from step 2 and trains steps 3 and 4 again, to the same metrics (the run is
    deterministic) and a new, intact step 4."""
    args = rl_args(tiny_model, arithmetic_data, tmp_path, reward=write_reward(tmp_path))
    torchrun(args, 2)
    first = metrics(tmp_path)
    ckpts = tmp_path / "checkpoints"
    shard, _ = flip_byte_in_tensor(
        ckpts / "step_00000004", key="actor.model.hf.model.embed_tokens.weight", file="__1_0.distcp"
    )

    out = torchrun([*args, "--resume", "auto"], 2).stdout
    for rank in (0, 1):
        assert re.search(
            rf"\[rlspmd\] rank {rank}: checkpoint.resume=auto: checkpoint {ckpts}/step_00000004 is damaged: "
            rf"{shard} does not match its recorded sha256: expected \w+, found \w+; resuming from the newest "
            r"intact checkpoint step_00000002 instead",
            out,
        ), out[-4000:]
    assert "step_00000002 at step 2" in out
    assert metrics(tmp_path) == first  # steps 3 and 4 trained again from step 2, identically
    assert len(list(ckpts.glob("step_00000004.damaged-*"))) == 1
    assert verify_checkpoint(ckpts / "step_00000004") is True
    recorded = json.loads((ckpts / "step_00000004" / "meta.json").read_text())["digests"]["files"]
    assert set(recorded) == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # both ranks' shards, rank 0's metadata
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
