"""Asynchronous RL in split placement (``trainer.max_staleness``): the pipeline's bookkeeping (which prompts, which
generator, which weight version each batch carries, the staleness metric), exact resume with a batch in flight, and
the in-flight batches' checkpoint encoding. 1 actor rank + 1 rollout rank, Gloo, the tiny model.

The synchronous loop (max_staleness 0) is held bit for bit to the colocated loop run in the same test session, and
within a tolerance (``rl_run.assert_close_to_recording``: bits differ between machines) to the split loop recorded
before asynchronous RL existed: on 1+1 ranks by ``tests/test_loss_parity.py`` (its losses), on 2+2 ranks here (every
metric; ``tests/data/async_parity.json``, recorded from commit eaf697f, the trainer before asynchronous RL, with
``RLSPMD_RECORD_ASYNC_PARITY=1`` in a checkout of it).
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from rl_run import assert_close_to_recording, assert_same_state, checkpoint_tensors, metrics, rl_args, write_reward
from rlspmd.protocol import Batch
from rlspmd.trainer.checkpoint import CheckpointError, InFlightBatches, decode_batch, encode_batch

SPLIT = ["--mesh.actor-ranks", "0", "--mesh.rollout-ranks", "1"]
SPLIT_2X2 = ["--mesh.actor-ranks", "0-1", "--mesh.rollout-ranks", "2-3"]
PER_STEP = ("reward/mean", "response_length/mean", "acc/mean", "tokens/response")
PARITY = Path(__file__).parent / "data" / "async_parity.json"
RECORD = os.environ.get("RLSPMD_RECORD_ASYNC_PARITY") == "1"


@pytest.fixture(scope="module")
def reward_fn(tmp_path_factory) -> str:
    return write_reward(tmp_path_factory.mktemp("reward"))


def run(model: Path, data: Path, out: Path, reward: str, *extra: str, steps: int = 4, nproc: int = 2) -> list[dict]:
    """``extra`` after 1+1 split placement (a later ``--mesh.*`` wins)."""
    torchrun(
        rl_args(
            model,
            data,
            out,
            steps=steps,
            reward=reward,
            extra=[*SPLIT, "--trainer.val-every", "0", "--trainer.no-val-before-train", *extra],
        ),
        nproc,
    )
    return metrics(out)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("placement, nproc", [(SPLIT, 2), (SPLIT_2X2, 4)], ids=["1+1", "2+2"])
def test_with_frozen_weights_the_pipeline_trains_on_the_synchronous_batches(
    placement, nproc, tiny_model, arithmetic_data, reward_fn, tmp_path
):
    """With the learning rate at 0 every weight version is the same model, so a pipelined run must train on exactly
    the synchronous run's batches, step for step: the same prompts (rank 0's sampler), the same generator per step,
    the samples routed back to the right step (and, on 2+2 ranks, to the right actor rank). Only the weight versions
    differ, and the staleness metric shows it."""
    frozen = ["--actor.optim.lr", "0", "--checkpoint.save-every", "0", "--checkpoint.no-save-final", *placement]
    sync = run(tiny_model, arithmetic_data, tmp_path / "sync", reward_fn, *frozen, nproc=nproc)
    for lag in (1, 2):
        rows = run(
            tiny_model,
            arithmetic_data,
            tmp_path / f"lag{lag}",
            reward_fn,
            *frozen,
            "--trainer.max-staleness",
            str(lag),
            nproc=nproc,
        )
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for step, (a, b) in enumerate(zip(sync, rows), 1):
            assert {k: a[k] for k in PER_STEP} == {k: b[k] for k in PER_STEP}, (lag, step)
            # the batch of step s was generated with the weights of step min(0, s - 1 - lag): staleness min(s - 1, lag)
            staleness = min(step - 1, lag)
            assert b["rollout/staleness/mean"] == b["rollout/staleness/max"] == staleness, (lag, step)
            assert b[f"rollout/staleness/frac_{staleness}"] == 1.0
            assert a["rollout/staleness/mean"] == 0.0 and a["rollout/staleness/frac_0"] == 1.0


def _differ(want: dict, got: dict, *, skip: tuple[str, ...] = ()) -> dict:
    """The metrics of ``want`` whose values ``got`` does not reproduce exactly (``skip``: name prefixes left out)."""
    return {k: (want[k], got.get(k)) for k in want if not k.startswith(skip) and got.get(k) != want[k]}


@pytest.mark.slow
@pytest.mark.dist
def test_two_plus_two_ranks_at_max_staleness_0_are_bit_identical_to_the_synchronous_loop(
    tiny_model, arithmetic_data, reward_fn, tmp_path
):
    """2 actor ranks + 2 rollout ranks, ``max_staleness=0``: the pipelined client and server (the exchange entered as
    two halves, weight versions, the staleness metric) give every metric of the synchronous loop bit for bit (losses,
    gradient norms, rewards, lengths, the rollout/train log-prob gap): of the colocated 2-rank loop run here (all but
    the weight-sync bytes, which only a split placement moves), and, within the tolerance for another machine's
    rounding, every metric of the split loop recorded before asynchronous RL existed."""
    base = [
        "--trainer.val-every",
        "0",
        "--trainer.no-val-before-train",
        "--checkpoint.save-every",
        "0",
        "--checkpoint.no-save-final",
    ]
    runs = {}
    for name, placement, nproc in (("colocated-2", [], 2), ("split-2x2", SPLIT_2X2, 4)):
        torchrun(
            rl_args(tiny_model, arithmetic_data, tmp_path / name, steps=3, reward=reward_fn, extra=[*placement, *base]),
            nproc,
            timeout=600,
        )
        runs[name] = metrics(tmp_path / name)
    if RECORD:  # in a checkout of the synchronous trainer; the file is then copied here
        PARITY.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
        return
    colocated, split = runs["colocated-2"], runs["split-2x2"]
    assert [r["step"] for r in split] == [r["step"] for r in colocated] == [1, 2, 3]
    for step, (a, b) in enumerate(zip(colocated, split), 1):
        assert set(a) <= set(b), (step, sorted(set(a) - set(b)))
        assert not _differ(a, b, skip=("weight_sync/",)), (step, _differ(a, b, skip=("weight_sync/",)))
        assert b["rollout/staleness/max"] == 0.0 and b["rollout/staleness/frac_0"] == 1.0
        assert a["weight_sync/broadcast_bytes"] == 0 < b["weight_sync/broadcast_bytes"]
    assert all(r["actor/grad_norm"] > 0 for r in split) and len({r["actor/grad_norm"] for r in split}) == 3
    recorded = json.loads(PARITY.read_text())
    assert_close_to_recording(split, recorded["split-2x2"], what="split-2x2")


@pytest.mark.slow
@pytest.mark.dist
def test_resume_with_a_batch_in_flight_is_bit_identical(tiny_model, arithmetic_data, reward_fn, tmp_path):
    """max_staleness 1: 4 steps == 2 steps, stop, resume for 2 more. The batch generated during step 2 (with step 1's
    weights, which the checkpoint no longer holds) is saved with the checkpoint and trained on at step 3, so every
    metric, weight, optimiser state and RNG state matches the uninterrupted run's."""
    args = ["--trainer.max-staleness", "1", "--checkpoint.save-every", "2"]
    reference = run(tiny_model, arithmetic_data, tmp_path / "reference", reward_fn, *args)
    assert [r["rollout/staleness/mean"] for r in reference] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["actor/grad_norm"] > 0 for r in reference)  # it learns (the default correction: truncated weights)
    assert reference[1]["rollout/logprob_gap"] > 1e-4  # stale: the trainer's log-probs are not the rollout's
    out = tmp_path / "resumed"
    full = rl_args(
        tiny_model,
        arithmetic_data,
        out,
        steps=4,
        reward=reward_fn,
        extra=[*SPLIT, "--trainer.val-every", "0", "--trainer.no-val-before-train", *args],
    )
    assert "stopped after step 2" in torchrun([*full, "--trainer.stop-at-step", "2"], 2).stdout
    ckpt = out / "checkpoints" / "step_00000002"
    saved = checkpoint_tensors(ckpt)
    in_flight = decode_batch(
        {k.split(".")[-1]: v for k, v in saved.items() if k.startswith("pipeline.rank_0.batch_0.")}
    )
    assert sorted(k for k in saved if k.startswith("pipeline.")) and len(in_flight) == 4 * 2  # prompts x rollout.n
    assert in_flight["weight_version_B"].tolist() == [1] * 8  # generated during step 2, with step 1's weights
    assert "resumed from" in torchrun([*full, "--resume", "auto"], 2).stdout
    assert metrics(out) == reference
    assert_same_state(
        checkpoint_tensors(tmp_path / "reference" / "checkpoints" / "step_00000004"),
        checkpoint_tensors(out / "checkpoints" / "step_00000004"),
    )


def test_in_flight_batches_round_trip_and_name_a_layout_from_another_world(tmp_path):
    batch = Batch(
        {
            "responses_BR": torch.tensor([[5, 6, 0], [7, 0, 0]]),
            "rollout_logprobs_BR": torch.randn(2, 3),
            "weight_version_B": torch.tensor([3, 3]),
        },
        {
            "ground_truth": ["11", "4"],
            "extra_info": [{"index": 7, "split": "train"}, {"index": 8}],
            "prompt_messages": [[{"role": "user", "content": "1 + 2 ="}]] * 2,
        },
    )
    back = decode_batch(encode_batch(batch))
    assert back.objects == batch.objects
    assert all(torch.equal(back[k], batch[k]) and back[k].dtype == batch[k].dtype for k in batch.tensors)

    queue = deque([batch])
    saving = InFlightBatches(queue, rank=1, device=torch.device("cpu"))
    state = saving.state_dict()
    assert set(state) == {"rank_1"} and set(state["rank_1"]) == {"batch_0"}
    layout = {
        f"{r}.{b}.{k}": (v.shape, v.dtype)
        for r, bs in state.items()
        for b, fields in bs.items()
        for k, v in fields.items()
    }
    loading = InFlightBatches(deque(), rank=1, device=torch.device("cpu"))
    with pytest.raises(CheckpointError, match="in-flight batches of 1 actor ranks .* this run has 2"):
        loading.expect(layout, path=tmp_path, dp=2)  # written by DP rank 1 alone: not this run's layout
    loading.expect({**layout, **{k.replace("rank_1", "rank_0"): v for k, v in layout.items()}}, path=tmp_path, dp=2)
    empty = loading.state_dict()  # what DCP fills: this rank's tensors, shaped as saved
    assert {k: v.shape for k, v in empty["rank_1"]["batch_0"].items()} == {
        k: v.shape for k, v in state["rank_1"]["batch_0"].items()
    }
    loading.load_state_dict(state)
    assert len(loading.queue) == 1 and loading.queue[0].objects == batch.objects and not loading.layout
