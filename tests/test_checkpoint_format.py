"""The checkpoint format (2) in one process: trainer and RNG state round-trip exactly as data, and loading a
checkpoint runs none of the code a hostile one could carry (in ``.metadata``, in a non-tensor leaf, or in a
format-1 trainer pickle)."""

from __future__ import annotations

import json
import os
import pickle
import random
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from rlspmd.config import CheckpointConfig
from rlspmd.distributed.runtime import rng_state
from rlspmd.trainer.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    Checkpointer,
    RNGState,
    TrainerState,
    dcp_load,
    read_checkpoint,
    read_dcp_metadata,
    to_json_text,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsCode:
    """Unpickling this runs a shell command that creates ``marker``: what a hostile checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_trainer_and_rng_state_round_trip_exactly(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # both generators now hold a cached Gaussian
    saved_rng = rng_state()
    snapshot = {
        "step": 7,
        "skipped_updates_total": 1.5,
        "components": {"sampler": {"epoch": 2, "position": 16}, "kl": {"value": 0.1 + 0.2}},
    }
    dcp.save({"trainer": TrainerState(snapshot), "rng": RNGState(0)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert json.loads(read_checkpoint(tmp_path)["trainer.json"]) == snapshot

    random.random(), np.random.random(), torch.rand(3)  # move every generator on
    restored = {}
    dcp_load({"trainer": TrainerState(restore=restored.update), "rng": RNGState(0)}, tmp_path, no_dist=True)
    assert restored == snapshot and restored["components"]["kl"]["value"] == 0.1 + 0.2  # floats bit-exact
    now = rng_state()
    assert now["python"] == saved_rng["python"] and now["python"][2] is not None
    for a, b in zip(now["numpy"], saved_rng["numpy"]):
        assert np.array_equal(a, b)
    assert torch.equal(now["torch"], saved_rng["torch"])
    assert random.random() == (random.setstate(saved_rng["python"]) or random.random())  # the same future draws


@pytest.mark.parametrize(
    "value, where",
    [
        ({"a": (1, 2)}, "a is a builtins.tuple"),
        ({"a": {"b": np.int64(3)}}, "a.b is a numpy.int64"),
        ({"a": {1: 2}}, "key 1 of a is a int"),
        ({"a": [1, torch.ones(1)]}, "a[1] is a torch.Tensor"),
    ],
)
def test_trainer_state_takes_json_types_only(value, where):
    with pytest.raises(TypeError, match=re.escape(f"trainer state: {where}")):
        TrainerState(value).state_dict()
    assert (
        to_json_text({"ok": [1, 2.5, None, "x", {"y": True}]}, what="x") == '{"ok": [1, 2.5, null, "x", {"y": true}]}'
    )


def test_hostile_metadata_is_refused_without_running(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata.*refusing to load posix\.system: not a DCP metadata type"):
        read_dcp_metadata(tmp_path)
    with pytest.raises(CheckpointException, match="refusing to load posix.system"):
        dcp_load({"w": torch.zeros(2)}, tmp_path, no_dist=True)
    assert not marker.exists()


def test_hostile_non_tensor_leaf_is_refused_without_running(tmp_path):
    """DCP stores non-tensor leaves with torch.save and reads them with weights_only=False; ours does not."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "extra": RunsCode(marker)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert not marker.exists()
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        dcp_load({"w": torch.zeros(2), "extra": None}, tmp_path / "ckpt", no_dist=True)
    assert not marker.exists()


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def write_format_1(path, marker):
    """A checkpoint as format 1 wrote it: weights as tensors, trainer and RNG state as pickled bytes (here a hostile
    pickle), meta.json with format 1."""
    weights = {"w": torch.arange(4.0)}
    trainer = {"pickle": pickle.dumps(RunsCode(marker))}
    dcp.save(
        {"actor": {"model": weights}, "trainer": trainer, "rng": {"rank_0": pickle.dumps(RunsCode(marker))}},
        checkpoint_id=str(path),
        no_dist=True,
    )
    (path / "meta.json").write_text(json.dumps({"format": 1, "step": 2, "world_size": 1, "trainer_components": []}))
    return weights


def test_format_1_is_refused_with_what_to_do(world_of_one, tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    marker = tmp_path / "ran"
    weights = write_format_1(ckpt, marker)
    loader = Checkpointer(CheckpointConfig(), output_dir=str(tmp_path), rank=0, world_size=1)
    restored = {}
    with pytest.raises(CheckpointError) as err:
        loader.load(
            ckpt, {"trainer": TrainerState(restore=restored.update), "rng": RNGState(0)}, engines={}, components=[]
        )
    message = str(err.value)
    assert f"checkpoint {ckpt} is format 1" in message and "Python pickles" in message
    assert f"python scripts/export_hf.py {ckpt} OUT" in message and f"this version (format {FORMAT_VERSION})" in message
    assert not marker.exists() and not restored
    # Its weights stay readable, tensors only: what export_hf does.
    assert torch.equal(read_checkpoint(ckpt, prefix="actor.")["actor.model.w"], weights["w"])
    assert not marker.exists()
