"""Multi-process tests under torchrun with Gloo: dispatch, meshes, FSDP2 gradients, failure, colocated rollout."""

import time

import pytest
import torch

from conftest import dist_script, torchrun

pytestmark = pytest.mark.dist


def test_dispatch_round_trips_2_ranks():
    assert "DISPATCH OK" in torchrun([dist_script("dispatch_check.py")], 2).stdout


def test_dispatch_and_disjoint_role_meshes_4_ranks():
    assert "DISPATCH OK" in torchrun([dist_script("dispatch_check.py")], 4).stdout


def test_fsdp2_two_rank_gradient_equals_one_rank(tiny_model, tmp_path):
    """Same global batch: 1 rank x 1 micro-batch, 2 ranks x 1 micro-batch, 2 ranks x 4 micro-batches."""
    runs = {}
    for nproc, micro in [(1, 8), (2, 4), (2, 1)]:
        out = tmp_path / f"g{nproc}_{micro}.pt"
        torchrun([dist_script("policy_grad_check.py"), str(tiny_model), str(out), str(micro), "token-mean"], nproc)
        runs[(nproc, micro)] = torch.load(out)["token-mean"]
    ref = runs[(1, 8)]
    assert any(g.abs().sum() > 0 for g in ref["grads"].values())
    for key, run in runs.items():
        assert run["pg_loss"] == pytest.approx(ref["pg_loss"], rel=1e-5, abs=1e-7), key
        for name, g in ref["grads"].items():
            torch.testing.assert_close(run["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key} {name}: {m}")


def test_throughput_options_keep_gradients_2_ranks(tiny_model):
    """Packing, token-budget micro-batches, DP balancing, activation checkpointing and CPU offload: same gradient of
    every optimiser step and same losses as padded fixed micro-batches; same old/ref log-probs (see the script)."""
    assert "THROUGHPUT OK" in torchrun([dist_script("throughput_check.py"), str(tiny_model)], 2).stdout


def test_exception_on_one_rank_ends_the_job_quickly():
    t0 = time.monotonic()
    proc = torchrun([dist_script("failure_check.py")], 2, check=False, timeout=120)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert elapsed < 60, f"took {elapsed:.1f}s"
    assert "UNREACHABLE" not in out
    assert out.count("ValueError: boom on rank 1: the reward file row 7 is malformed") == 1, out[-3000:]
    assert out.count("Traceback (most recent call last)") >= 1


def test_dead_peer_without_agent_times_out(tmp_path):
    """Without torchrun's agent killing survivors, the collective timeout still ends the waiting rank."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, dist_script("failure_check.py"), "5"], cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    t0 = time.monotonic()
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert time.monotonic() - t0 < 60
    assert all(p.returncode != 0 for p in procs)
    assert "boom on rank 1" in outs[1]
    assert "UNREACHABLE" not in outs[0]


def test_colocated_native_engine_reads_fsdp_weights_in_place(tiny_model):
    assert "COLOCATED OK" in torchrun([dist_script("native_colocated_check.py"), str(tiny_model)], 2).stdout
