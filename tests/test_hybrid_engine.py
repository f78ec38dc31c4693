"""The hybrid engine on CPU (Gloo): the weight stream, split placement, placement validation."""

import pytest
import torch

from conftest import dist_script, load_script, torchrun
from rlspmd.distributed.mesh import ParallelDims
from rlspmd.config import Config, MeshConfig, NativeConfig, RolloutConfig, VllmConfig
from rlspmd.validate import config_problems


@pytest.mark.dist
def test_weight_stream_2_ranks_tied_embeddings(tiny_model):
    assert "WEIGHT STREAM OK" in torchrun([dist_script("weight_stream_check.py"), str(tiny_model)], 2).stdout


@pytest.mark.dist
@pytest.mark.slow  # 15 s; the 2-rank stream above stays in the quick subset
def test_weight_stream_4_ranks_untied_and_split_bridge(tmp_path):
    model = load_script("scripts/models/build_tiny.py").build(tmp_path / "llama", arch="llama", tie_embeddings=False)
    assert "WEIGHT STREAM OK" in torchrun([dist_script("weight_stream_check.py"), str(model)], 4).stdout


def _two_steps(tmp_path, name, nproc, model, data, *extra):
    out = tmp_path / f"{name}.pt"
    torchrun(
        [
            dist_script("split_rollout_check.py"),
            str(out),
            "--actor.model.path",
            str(model),
            "--data.train-files",
            str(data / "train.parquet"),
            "--data.val-files",
            str(data / "test.parquet"),
            "--data.train-batch-size",
            "4",
            "--actor.mini-batch-size",
            "2",
            "--actor.micro-batch-size",
            "4",
            "--rollout.n",
            "2",
            "--rollout.max-response-length",
            "8",
            "--actor.optim.lr",
            "1e-3",
            "--actor.optim.warmup-steps",
            "0",
            "--trainer.loggers",
            "jsonl",
            "--trainer.output-dir",
            str(tmp_path / name),
            *extra,
        ],
        nproc,
    )
    return torch.load(out)


SPLIT = ("--mesh.actor-ranks", "0-1", "--mesh.rollout-ranks", "2-3")


RUNS = {
    "rollout_tp1": [],
    "rollout_tp2": ["--mesh.rollout-tp", "2"],
    # greedy baseline calls and a data-dependent number of generation rounds per step: the rollout ranks follow
    "remax_dynamic_sampling": [
        "algorithm.adv-estimator:remax",
        "--algorithm.filter-groups.enable",
        "--algorithm.filter-groups.max-rounds",
        "3",
    ],
}


@pytest.fixture(scope="module", params=list(RUNS))
def two_step_runs(request, tiny_model, arithmetic_data, tmp_path_factory):
    """The same two RL steps colocated on 2 ranks and split over 2+2 ranks (same seed and rollout DP layout)."""
    tmp = tmp_path_factory.mktemp(request.param)
    extra = RUNS[request.param]
    return {
        "name": request.param,
        "colocated": _two_steps(tmp, "colocated", 2, tiny_model, arithmetic_data, *extra),
        "split": _two_steps(tmp, "split", 4, tiny_model, arithmetic_data, *extra, *SPLIT),
    }


@pytest.mark.dist
def test_split_placement_matches_colocated(two_step_runs):
    """Actor+ref on ranks 0-1 and the rollout on ranks 2-3 give the colocated 2-rank run's samples and rewards, step
    after step: prompts cross to the rollout mesh and samples come back in order, and the weights the rollout ranks
    receive after each update are the actor's (the rollout-vs-trainer log-prob gap stays at float noise)."""
    colocated, split = two_step_runs["colocated"], two_step_runs["split"]
    for step, (a, b) in enumerate(zip(colocated["batches"], split["batches"]), 1):
        for key in ("responses_BR", "scores_B", "rollout_logprobs_BR"):
            assert torch.equal(a[key], b[key]), (step, key)
    assert not torch.equal(colocated["batches"][0]["responses_BR"], colocated["batches"][1]["responses_BR"])
    for a, b in zip(colocated["metrics"], split["metrics"]):
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-6) and a["actor/grad_norm"] > 0
        assert b["rollout/logprob_gap"] < 1e-5, "the rollout generated with stale weights"
        assert a["weight_sync/loaded_bytes"] == 0 and a["weight_sync/broadcast_bytes"] == 0  # colocated: in place
        assert b["weight_sync/broadcast_bytes"] >= b["weight_sync/loaded_bytes"] > 0  # split: the model crossed
        assert b["weight_sync/gathered_bytes"] > 0 and b["throughput/rollout/gen_tokens_per_s"] > 0
        for key in (
            "timing/rollout/weight_sync",
            "timing/rollout/wake",
            "timing/rollout/sleep",
            "timing/rollout/gen",
            "throughput/rollout/gen_tokens_per_s",
        ):
            assert key in a and key in b, key


@pytest.mark.dist
def test_split_placement_stops_checkpoints_and_resumes(two_step_runs, tiny_model, arithmetic_data, tmp_path):
    """The CLI in split placement: checkpoints are collective over the actor ranks only, the rollout ranks serve
    until the trainer closes them, and after a resume the rollout gets the restored weights before generating
    (step 2 equals the uninterrupted run's)."""
    import json

    if two_step_runs["name"] != "rollout_tp1":
        pytest.skip("one resume check is enough (against the rollout_tp1 runs)")
    out = tmp_path / "resume"
    args = [
        "-m",
        "rlspmd.train",
        "--config",
        "configs/quickstart.py",
        "--actor.model.path",
        str(tiny_model),
        "--reward.function",
        f"{dist_script('split_rollout_check.py')}:digit_reward",
        "--data.train-files",
        str(arithmetic_data / "train.parquet"),
        "--data.val-files",
        str(arithmetic_data / "test.parquet"),
        "--data.train-batch-size",
        "4",
        "--actor.mini-batch-size",
        "2",
        "--actor.micro-batch-size",
        "4",
        "--rollout.n",
        "2",
        "--rollout.max-response-length",
        "8",
        "--actor.optim.lr",
        "1e-3",
        "--actor.optim.warmup-steps",
        "0",
        "--trainer.total-steps",
        "2",
        "--trainer.no-val-before-train",
        "--trainer.val-every",
        "0",
        "--trainer.loggers",
        "jsonl",
        "--trainer.output-dir",
        str(out),
        *SPLIT,
    ]
    first = torchrun([*args, "--trainer.stop-at-step", "1"], 4)
    assert "stopped after step 1" in first.stdout
    torchrun([*args, "--resume", "auto"], 4)
    rows = {r["step"]: r for r in map(json.loads, open(out / "metrics.jsonl"))}
    assert sorted(rows) == [1, 2] and (out / "checkpoints" / "step_00000002").is_dir()
    expected = two_step_runs["split"]["metrics"][1]
    for key in ("actor/grad_norm", "reward/mean", "rollout/logprob_gap"):
        assert rows[2][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key


def _placement_problems(world, *, engine=NativeConfig(), **ranks) -> list[str]:
    """``rlspmd.validate``'s findings about the placement alone (the only check of it, run before anything loads)."""
    cfg = Config(mesh=MeshConfig(**{f"{k}_ranks": v for k, v in ranks.items()}), rollout=RolloutConfig(engine=engine))
    cfg.data.train_batch_size, cfg.actor.mini_batch_size = 60, 60  # divisible by every DP size below
    return [
        line
        for line in config_problems(cfg, world_size=world, check_files=False)
        if line.startswith(("mesh.", "rollout.engine"))
    ]


def test_placement_rules():
    assert _placement_problems(4, engine=VllmConfig()) == []  # colocated
    assert _placement_problems(4, actor="0-1", rollout="2-3") == []
    dims = ParallelDims.from_config(MeshConfig(actor_ranks="0-1", rollout_ranks="2-3"), 4)
    assert (
        dims.role_ranks["ref"] == dims.role_ranks["critic"] == dims.role_ranks["reward"] == [0, 1]
    )  # they follow the actor
    assert _placement_problems(8, actor="0-5", rollout="6-7") == []
    bad = [
        (dict(actor="2-3", rollout="0-1"), "must include rank 0"),
        (dict(actor="0-2", rollout="2-3"), "share none with them"),
        (dict(actor="0-1", rollout="2"), "ranks [3] of the 4 host no role"),
    ]
    for ranks, message in bad:
        found = _placement_problems(4, **ranks)
        assert len(found) == 1 and message in found[0], (ranks, found)
    found = _placement_problems(4, engine=VllmConfig(), actor="0-1", rollout="2-3")
    assert len(found) == 1 and "runs colocated only" in found[0], found


@pytest.mark.dist
@pytest.mark.slow
def test_colocated_native_with_its_own_bf16_copy_is_fed_by_the_stream(tiny_model, arithmetic_data, tmp_path):
    """A rollout dtype other than the actor's compute dtype: the native engine keeps its own copy, loaded from the
    weight stream (cast to bf16 on the shards) at every sync; training and generation still run."""
    import json

    out = tmp_path / "bf16"
    torchrun(
        [
            "-m",
            "rlspmd.train",
            "--config",
            "configs/quickstart.py",
            "--actor.model.path",
            str(tiny_model),
            "--data.train-files",
            str(arithmetic_data / "train.parquet"),
            "--data.val-files",
            str(arithmetic_data / "test.parquet"),
            "--data.train-batch-size",
            "4",
            "--actor.mini-batch-size",
            "2",
            "--actor.micro-batch-size",
            "4",
            "--rollout.n",
            "2",
            "--rollout.max-response-length",
            "8",
            "--rollout.dtype",
            "bfloat16",
            "--trainer.total-steps",
            "2",
            "--trainer.no-val-before-train",
            "--trainer.val-every",
            "0",
            "--trainer.loggers",
            "jsonl",
            "--trainer.output-dir",
            str(out),
        ],
        2,
    )
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    n_params = sum(
        p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model).parameters()
    )
    for row in rows:
        assert row["weight_sync/loaded_bytes"] == 2 * n_params  # bf16, tied embedding once
        assert (
            0 < row["weight_sync/gathered_bytes"] <= row["weight_sync/loaded_bytes"]
        )  # 2 ranks: half comes from the peer
        assert 0 < row["rollout/logprob_gap"] < 0.1  # bf16 rollout vs fp32 trainer: small but not zero
